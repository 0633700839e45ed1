"""``/mcp``: capsa's MCP server over streamable HTTP, behind the API's authentication.

Every request must carry a valid API key (else 401 problem+json, like any route); the MCP tools then act
with that key through the API itself (:mod:`capsa.mcp.http`), so a key reaches only its tenant's
sessions. Without the optional ``mcp`` package the route answers 501 ``mcp_unavailable``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from capsa.control.auth import authenticate, bearer_token
from capsa.control.errors import Unauthorized
from capsa.control.plane import ControlPlane
from capsa.control.problems import problem_response
from capsa.mcp import MISSING_EXTRA, available

__all__ = ["MCP_PATH", "install_mcp"]

MCP_PATH = "/mcp"
_METHODS = ["GET", "POST", "DELETE"]


@contextlib.asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


class _Authenticated:
    """Refuses a request without a valid API key before it reaches ``inner``."""

    def __init__(self, app: FastAPI, inner: ASGIApp) -> None:
        self._app = app
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        plane = getattr(self._app.state, "plane", None)
        if not isinstance(plane, ControlPlane):
            await problem_response(503, "not_ready", "the control plane is starting")(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope).get("authorization"))
        try:
            async with plane.db() as db:
                await authenticate(db, token)
        except Unauthorized as exc:
            response = problem_response(exc.status, exc.code, exc.message, headers=exc.headers)
            await response(scope, receive, send)
            return
        await self._inner(scope, receive, send)


async def _unavailable(_request: Request) -> Response:
    return problem_response(501, "mcp_unavailable", MISSING_EXTRA)


def install_mcp(app: FastAPI) -> Callable[[], AbstractAsyncContextManager[None]]:
    """Route ``/mcp`` of ``app``; returns what its lifespan must enter around serving."""
    if not available():
        app.router.routes.append(Route(MCP_PATH, _unavailable, methods=_METHODS, include_in_schema=False))
        return _nothing
    from capsa.mcp.http import McpHttp

    endpoint = McpHttp(app, path=MCP_PATH)
    app.router.routes.append(Route(MCP_PATH, _Authenticated(app, endpoint), methods=_METHODS,
                                   include_in_schema=False))
    return endpoint.run

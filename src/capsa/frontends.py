"""The composition root of the control plane's HTTP app: the control plane (:mod:`capsa.control.app`)
with its front ends, which the control plane itself does not import:

- ``/e2b`` (setting ``e2b_compat``): the E2B dialect, :mod:`capsa.compat.e2b`; its paths are checked by
  the request guard with their own credentials (``X-API-KEY``, ``X-Access-Token``) and message limit
  whether it is served or not;
- ``/mcp``: capsa's MCP server over streamable HTTP, behind the API's authentication. Every request must
  carry a valid API key (else 401 problem+json, like any route); the MCP tools then act with that key
  through the API itself (:mod:`capsa.mcp.http`), so a key reaches only its tenant's sessions. Without the
  optional ``mcp`` package the route answers 501 ``mcp_unavailable``.

``capsa control`` (:mod:`capsa.control.server`) and ``capsa serve`` build their app with :func:`build_app`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from capsa.common.request_guard import BodyRule
from capsa.common.request_limits import RequestLimits
from capsa.compat.e2b import ENVD_PATH, MOUNT_PATH, access, create_e2b_app
from capsa.compat.e2b.connect import MAX_MESSAGE_BYTES
from capsa.control.app import create_app
from capsa.control.audit.anchor import CheckpointSink
from capsa.control.auth import authenticate, bearer_token
from capsa.control.errors import Unauthorized
from capsa.control.front_ends import FrontEnd, FrontEndGate, Lifetime, PlaneGetter
from capsa.control.plane import ControlPlane
from capsa.control.problems import problem_response
from capsa.control.settings import ControlSettings
from capsa.mcp import MISSING_EXTRA, available

__all__ = ["MCP_BODY_BYTES", "MCP_PATH", "build_app", "e2b_front_end", "mcp_front_end"]

MCP_PATH = "/mcp"
_METHODS = ["GET", "POST", "DELETE"]

MCP_BODY_BYTES = 4 << 20
"""Largest MCP request over HTTP: the MCP SDK's default limit, so a tool call the transport would take is
never cut here first."""


def build_app(settings: ControlSettings | None = None,
              on_bootstrap_key: Callable[[str], None] | None = None,
              checkpoint_sink: CheckpointSink | None = None,
              request_limits: RequestLimits | None = None) -> FastAPI:
    """The control plane's app (:func:`capsa.control.app.create_app`, same arguments) with ``/mcp`` and
    ``/e2b``."""
    settings = settings or ControlSettings()
    return create_app(settings, on_bootstrap_key, checkpoint_sink, request_limits,
                      front_ends=(mcp_front_end(), e2b_front_end(settings)))


def e2b_front_end(settings: ControlSettings) -> FrontEnd:
    """The E2B dialect at ``/e2b`` when ``e2b_compat`` is on; its paths' credentials and body limits."""
    envd = re.escape(MOUNT_PATH + ENVD_PATH)
    files = settings.max_file_bytes
    gate = FrontEndGate(MOUNT_PATH, access.check_credential, [
        BodyRule(envd + r"/files", frozenset({"POST"}), files),
        BodyRule(envd + r"/process\.Process/StreamInput", frozenset({"POST"}), files),
        BodyRule(envd + r"/(process\.Process|filesystem\.Filesystem)/[^/]+", frozenset({"POST"}),
                 MAX_MESSAGE_BYTES + 5, streamed=False),
    ])

    def install(app: FastAPI, plane: PlaneGetter) -> Lifetime | None:
        if settings.e2b_compat:
            app.mount(MOUNT_PATH, create_e2b_app(plane))
        return None

    return FrontEnd(install, gate)


def mcp_front_end() -> FrontEnd:
    """``/mcp`` (an API key in ``Authorization: Bearer``, as ``/v1``; the MCP SDK's own body limit)."""
    # MCP over HTTP: the MCP SDK's own request limit (4 MiB), which its transport enforces too.
    gate = FrontEndGate(MCP_PATH, rules=[BodyRule(r"/mcp/?", frozenset({"POST"}), MCP_BODY_BYTES,
                                                  streamed=False)])
    return FrontEnd(_install_mcp, gate)


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


def _install_mcp(app: FastAPI, _plane: PlaneGetter) -> Lifetime:
    """Route ``/mcp`` of ``app``; returns what its lifespan must enter around serving."""
    if not available():
        app.router.routes.append(Route(MCP_PATH, _unavailable, methods=_METHODS, include_in_schema=False))
        return _nothing
    from capsa.mcp.http import McpHttp

    endpoint = McpHttp(app, path=MCP_PATH)
    app.router.routes.append(Route(MCP_PATH, _Authenticated(app, endpoint), methods=_METHODS,
                                   include_in_schema=False))
    return endpoint.run

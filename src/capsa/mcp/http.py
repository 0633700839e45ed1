"""capsa's MCP tools over streamable HTTP, as an ASGI app the control plane mounts (at ``/mcp``).

Each tool call acts with the API key of the HTTP request that carried it: the tool's SDK client sends that
key to the API application given here (in process, through
:class:`~capsa.mcp.asgi_transport.StreamingASGITransport`), so the API's own
authentication, tenant scoping and rate limits apply to MCP exactly as to REST. The transport is
stateless (no MCP session is kept between requests) with JSON answers, so any replica can serve any
request. Checking that a request has a valid key at all is the mounting application's job.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from importlib.metadata import version
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import ASGIApp, Receive, Scope, Send

from capsa.mcp.asgi_transport import StreamingASGITransport
from capsa.mcp.tools import Ctx, build_server
from capsa.sdk import AsyncClient

__all__ = ["INTERNAL_URL", "McpHttp", "bearer_key"]

INTERNAL_URL = "http://capsa.internal"
"""The base URL of in-process API calls (never resolved: the transport hands requests to the app)."""


def bearer_key(headers: Any) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, if there is one."""
    value = headers.get("authorization") if headers is not None else None
    if not isinstance(value, str):
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class McpHttp:
    """The MCP endpoint at ``path``, whose tools call ``api`` with each request's key.

    ``app`` is the ASGI app to route ``path`` to; :meth:`run` must be entered (in the mounting app's
    lifespan) before it serves.
    """

    def __init__(self, api: ASGIApp, *, path: str = "/mcp") -> None:
        self._transport = StreamingASGITransport(api)

        @contextlib.asynccontextmanager
        async def clients(ctx: Ctx) -> AsyncIterator[AsyncClient]:
            key = bearer_key(ctx.headers)
            if key is None:
                raise ToolError("unauthorized: the MCP request carried no API key")
            async with AsyncClient(INTERNAL_URL, key, transport=self._transport) as client:
                yield client

        self.server = build_server(clients, version=version("capsa"))
        # The key is checked on every request, so there is no cookie a rebinding attack could ride on;
        # the Host header names whatever the deployment calls the control plane.
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        self.app: ASGIApp = self.server.streamable_http_app(streamable_http_path=path, stateless_http=True,
                                                            json_response=True, transport_security=security)

    def run(self) -> AbstractAsyncContextManager[None]:
        """The session manager's lifetime (its task group): enter it before serving requests."""
        return self.server.session_manager.run()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

"""``capsa mcp``: capsa's MCP tools over stdio, acting with one API key (``CAPSA_API_KEY``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import version

from capsa.mcp.tools import Ctx, build_server
from capsa.sdk import AsyncClient

__all__ = ["serve_stdio"]


async def serve_stdio(api_url: str | None = None, api_key: str | None = None) -> None:
    """Serve MCP on this process's stdin/stdout until the client closes it. Every tool call uses one SDK
    client (``api_url``/``api_key``, else ``CAPSA_API_URL``/``CAPSA_API_KEY``)."""
    async with AsyncClient(api_url, api_key) as client:

        @contextlib.asynccontextmanager
        async def clients(_ctx: Ctx) -> AsyncIterator[AsyncClient]:
            yield client

        server = build_server(clients, version=version("capsa"))
        await server.run_stdio_async()

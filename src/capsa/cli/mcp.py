"""``capsa mcp``: serve capsa's MCP tools on stdin/stdout for an MCP client that spawns this command."""

from __future__ import annotations

import asyncio
import contextlib

import click

from capsa.cli.output import ApiOptions, api_options, fail, reports_errors
from capsa.mcp import MISSING_EXTRA, available

__all__ = ["mcp"]


@click.command("mcp")
@api_options
def mcp(api: ApiOptions) -> None:
    """Serve capsa's MCP tools (sessions, commands, files) over stdio.

    An MCP client runs this command and talks MCP on its stdin/stdout; every tool acts with the API key
    given here (or CAPSA_API_KEY). The same tools are served over streamable HTTP at the control plane's
    /mcp, with the caller's key.
    """
    if not available():
        fail(MISSING_EXTRA)
    from capsa.mcp.stdio import serve_stdio

    with reports_errors(), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_stdio(api.api_url, api.api_key))

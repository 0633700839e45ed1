"""capsa as an MCP server (``pip install 'capsa[mcp]'``): sessions, commands and files as MCP tools.

- :mod:`capsa.mcp.tools`: the tools and their JSON schemas, written against the public SDK only; every
  tool gets its :class:`capsa.sdk.AsyncClient` from a :data:`~capsa.mcp.tools.ClientSource`, so the same
  tools serve both transports.
- :mod:`capsa.mcp.stdio`: ``capsa mcp`` (stdio; one client from ``CAPSA_API_URL``/``CAPSA_API_KEY``).
- :mod:`capsa.mcp.http`: the streamable HTTP app the control plane mounts at ``/mcp``; each tool call
  acts with the API key of the HTTP request that carried it.

This package's ``__init__`` imports nothing from the ``mcp`` distribution, so code can check
:data:`MISSING_EXTRA` / :func:`available` without it installed.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MISSING_EXTRA", "available"]

MISSING_EXTRA = "the MCP server needs the mcp package: pip install 'capsa[mcp]'"


def available() -> bool:
    """True when the ``mcp`` distribution can be imported."""
    return importlib.util.find_spec("mcp") is not None

"""A node agent's HTTP API in process (``httpx`` over ASGI, no socket), as the control plane calls it, and
the two calls the VM tests make most: one that must answer a status, and a shell command that must succeed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from capsa.node.agent.agent import NodeAgent
from capsa.node.api.app import create_node_app

__all__ = ["TOKEN", "node_api", "ok", "sh"]

TOKEN = "t" * 32


@contextlib.asynccontextmanager
async def node_api(agent: NodeAgent) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``agent``'s API (``/node/v1``), authorised with :data:`TOKEN`."""
    transport = httpx.ASGITransport(app=create_node_app(agent, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1",
                                 headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300) as client:
        yield client


async def ok(resp: httpx.Response, status: int = 200) -> Any:
    """The JSON body of ``resp`` (None when empty), which must have answered ``status``."""
    assert resp.status_code == status, resp.text
    return resp.json() if resp.content else None


async def sh(api: httpx.AsyncClient, sid: str, cmd: str, timeout: float = 30) -> str:  # noqa: ASYNC109
    """The stdout of ``sh -c cmd`` in sandbox ``sid``, which must exit 0."""
    res = await ok(await api.post(f"/sandboxes/{sid}/exec",
                                  json={"cmd": ["sh", "-c", cmd], "timeout": timeout}))
    assert res["exit_code"] == 0, res
    return str(res["stdout"])

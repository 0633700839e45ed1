"""Node administration (admin keys only): list the nodes, make one-time enrolment tokens for new ones, drain a
node for maintenance."""

from __future__ import annotations

import builtins
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from capsa.sdk.portal import Blocking
from capsa.sdk.resource import Resource

__all__ = ["AsyncNodes", "DrainResult", "DrainStayed", "EnrolToken", "NodeInfo", "Nodes"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class NodeInfo(_Model):
    id: str
    name: str | None = None
    url: str
    healthy: bool
    """Heartbeating and not stopping: the node can get new sessions."""
    capacity: dict[str, int]
    used: dict[str, int]
    templates: list[str] = []
    egress: bool = False
    store: str | None = None
    """The fleet store the node's snapshots go to (nodes of one store restore each other's snapshots)."""
    draining: bool = False
    """Its sessions are being moved off (``capsa nodes drain``); it gets no new ones."""
    registered_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    left_at: datetime | None = None


class EnrolToken(_Model):
    token: str
    """Give it to ``capsa node --enrol-token``; it works once, until ``expires_at``."""
    expires_at: datetime | None = None


class DrainStayed(_Model):
    session_id: str
    reason: str
    """Why it did not move (it stays paused and can be resumed)."""


class DrainResult(_Model):
    node: NodeInfo
    moved: list[str]
    """Sessions now running on another node, with their memory, processes and files."""
    stayed: list[DrainStayed] = []
    drained: bool
    """No session holds a sandbox on the node any more."""


class AsyncNodes(Resource):
    """Node administration (admin keys only)."""

    async def list(self) -> builtins.list[NodeInfo]:
        return await self._list(NodeInfo, "/nodes")

    async def create_token(self, *, ttl_seconds: int | None = None) -> EnrolToken:
        body = {"ttl_seconds": ttl_seconds} if ttl_seconds is not None else {}
        return await self._call(EnrolToken, "POST", "/nodes/tokens", json=body)

    async def drain(self, node_id: str) -> DrainResult:
        """Stop placing sessions on the node and move its running ones to other nodes (waits for them)."""
        return await self._call(DrainResult, "POST", f"/nodes/{node_id}/drain", timeout=None)

    async def undrain(self, node_id: str) -> NodeInfo:
        return await self._call(NodeInfo, "POST", f"/nodes/{node_id}/undrain")


class Nodes(Blocking[AsyncNodes]):
    """Node administration (admin keys only)."""

    def list(self) -> builtins.list[NodeInfo]:
        return self._portal.call(self._inner.list())

    def create_token(self, *, ttl_seconds: int | None = None) -> EnrolToken:
        return self._portal.call(self._inner.create_token(ttl_seconds=ttl_seconds))

    def drain(self, node_id: str) -> DrainResult:
        return self._portal.call(self._inner.drain(node_id))

    def undrain(self, node_id: str) -> NodeInfo:
        return self._portal.call(self._inner.undrain(node_id))

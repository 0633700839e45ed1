"""Node administration (admin keys only): list the nodes, make one-time enrolment tokens for new ones."""

from __future__ import annotations

import builtins
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from capsa.sdk.portal import Blocking
from capsa.sdk.resource import Resource

__all__ = ["AsyncNodes", "EnrolToken", "NodeInfo", "Nodes"]


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
    registered_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    left_at: datetime | None = None


class EnrolToken(_Model):
    token: str
    """Give it to ``capsa node --enrol-token``; it works once, until ``expires_at``."""
    expires_at: datetime | None = None


class AsyncNodes(Resource):
    """Node administration (admin keys only)."""

    async def list(self) -> builtins.list[NodeInfo]:
        return await self._list(NodeInfo, "/nodes")

    async def create_token(self, *, ttl_seconds: int | None = None) -> EnrolToken:
        body = {"ttl_seconds": ttl_seconds} if ttl_seconds is not None else {}
        return await self._call(EnrolToken, "POST", "/nodes/tokens", json=body)


class Nodes(Blocking[AsyncNodes]):
    """Node administration (admin keys only)."""

    def list(self) -> builtins.list[NodeInfo]:
        return self._portal.call(self._inner.list())

    def create_token(self, *, ttl_seconds: int | None = None) -> EnrolToken:
        return self._portal.call(self._inner.create_token(ttl_seconds=ttl_seconds))

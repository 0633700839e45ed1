"""The tenant audit chain from the SDK (``client.audit``): page and filter events by session, kind and
time, iterate them all, and have the server verify the chain.

Every event carries ``request_id`` (the ``X-Request-Id`` of the API response that caused it), the
session it concerns, and ``prev_hash``/``hash`` linking it to the tenant's previous event; see
docs/audit.md for the canonical form a verifier recomputes.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from capsa.sdk.resource import Resource

__all__ = ["AUDIT_KINDS", "AsyncAudit", "AuditCheckpoint", "AuditPage", "AuditRecord", "AuditVerification"]

AUDIT_KINDS = ("api", "session", "command", "file", "egress", "approval", "connection")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class AuditRecord(_Model):
    id: int
    """The event's number in the tenant's chain (1, 2, ...)."""
    time: datetime
    time_us: int
    kind: str
    """One of :data:`AUDIT_KINDS`."""
    action: str
    tenant: str
    key_id: str | None = None
    request_id: str | None = None
    session_id: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    prev_hash: str
    hash: str


class AuditPage(_Model):
    items: list[AuditRecord]
    next_cursor: str | None = None


class AuditVerification(_Model):
    ok: bool
    checked: int
    head: int
    broken_id: int | None = None
    """The first missing or altered event (None when ``ok``)."""
    reason: str | None = None
    code: str | None = None
    """Why not ``ok``: ``audit_chain_broken``, ``audit_chain_truncated`` (the chain ends before what a
    signed checkpoint vouches for) or ``audit_checkpoint_invalid`` (the checkpoint log was tampered with)."""
    anchor: int | None = None
    """The highest event a signed checkpoint vouches for (None: none was compared)."""


class AuditCheckpoint(_Model):
    n: int
    tenant: str
    seq: int
    """The event of the chain the checkpoint vouches for."""
    hash: str
    time: datetime
    purpose: str
    key: str


def _params(session_id: str | None, kind: str | Sequence[str] | None, since: datetime | None,
            until: datetime | None, cursor: str | None, limit: int) -> dict[str, Any]:
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    return {"limit": limit, "session_id": session_id, "kind": kinds or None,  # a list repeats the key
            "since": since.isoformat() if since else None, "until": until.isoformat() if until else None,
            "cursor": cursor or None}


class AsyncAudit(Resource):
    """The caller's tenant audit chain (``client.audit``)."""

    async def page(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
                   since: datetime | None = None, until: datetime | None = None, cursor: str | None = None,
                   limit: int = 100) -> AuditPage:
        """One page, oldest first; pass its ``next_cursor`` back for the next one."""
        return await self._call(AuditPage, "GET", "/audit",
                                params=_params(session_id, kind, since, until, cursor, limit))

    async def iter(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
                   since: datetime | None = None, until: datetime | None = None,
                   page_size: int = 500) -> AsyncIterator[AuditRecord]:
        cursor: str | None = None
        while True:
            page = await self.page(session_id=session_id, kind=kind, since=since, until=until, cursor=cursor,
                                   limit=page_size)
            for record in page.items:
                yield record
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def list(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
                   since: datetime | None = None, until: datetime | None = None,
                   limit: int | None = None) -> builtins.list[AuditRecord]:
        out: builtins.list[AuditRecord] = []
        async for record in self.iter(session_id=session_id, kind=kind, since=since, until=until):
            out.append(record)
            if limit is not None and len(out) >= limit:
                break
        return out

    async def verify(self) -> AuditVerification:
        """Have the control plane recompute the whole chain (``GET /v1/audit/verify``)."""
        return await self._call(AuditVerification, "GET", "/audit/verify")

    async def checkpoint(self) -> AuditCheckpoint:
        """Have the control plane sign the chain's head into its anchor now
        (``POST /v1/audit/checkpoints``)."""
        return await self._call(AuditCheckpoint, "POST", "/audit/checkpoints")

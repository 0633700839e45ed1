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

from capsa.common.wire.audit import AuditChainEvent, AuditChainList, AuditCheckpointOut, AuditVerifyOut
from capsa.sdk.resource import Resource

__all__ = ["AsyncAudit", "AuditCheckpoint", "AuditPage", "AuditRecord", "AuditVerification"]

AuditRecord = AuditChainEvent
"""One event of the chain; ``kind`` is one of ``AUDIT_KINDS``."""
AuditPage = AuditChainList
"""One page of events; pass its ``next_cursor`` back for the next one."""
AuditVerification = AuditVerifyOut
"""What the server found when it recomputed the chain (``ok``, or the first break and why)."""
AuditCheckpoint = AuditCheckpointOut
"""A signed checkpoint of the chain's head."""


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

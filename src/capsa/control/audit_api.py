"""What ``/v1/audit`` does: a tenant's chain, paged and filtered, and its verification. Node-side events
of the sessions concerned are collected from their nodes first, so a read sees what already happened."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select

from capsa.common.ids import is_id
from capsa.control import audit_trail
from capsa.control.audit_schemas import AuditChainEvent, AuditChainList, AuditVerifyOut
from capsa.control.egress import collect_audit
from capsa.control.errors import ValidationFailed
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.store.audit_models import AuditTrailRow
from capsa.control.store.models import NodeRow, SessionRow

__all__ = ["event_out", "list_chain", "verify_chain"]

log = logging.getLogger(__name__)

_LIVE = ("creating", "running")


async def _collect(plane: ControlPlane, tenant: str, session_id: str | None) -> None:
    query = select(SessionRow.node_id).where(SessionRow.tenant == tenant, SessionRow.node_id.is_not(None))
    if session_id is not None:
        query = query.where(SessionRow.id == session_id)
    else:
        query = query.where(SessionRow.state.in_(_LIVE))
    async with plane.db() as db:
        node_ids = {i for i in (await db.execute(query.distinct())).scalars() if i}
        nodes = [n for n in [await db.get(NodeRow, i) for i in sorted(node_ids)] if n is not None]
    for node in nodes:
        try:
            await collect_audit(plane, node)
        except (NodeError, KeyError, ValueError) as exc:
            log.warning("could not collect audit events from node %s: %s", node.id, exc)


def event_out(row: AuditTrailRow) -> AuditChainEvent:
    return AuditChainEvent(id=row.seq, time=datetime.fromtimestamp(row.time_us / 1_000_000, UTC),
                           time_us=row.time_us, kind=row.kind, action=row.action, tenant=row.tenant,
                           key_id=row.key_id, request_id=row.request_id, session_id=row.session_id,
                           detail=row.detail, prev_hash=row.prev_hash, hash=row.hash)


def _after(cursor: str | None) -> int:
    if not cursor:
        return 0
    if not cursor.isdigit() or len(cursor) > 19:
        raise ValidationFailed("invalid cursor", [{"field": "query.cursor", "message": "invalid cursor"}])
    return int(cursor)


def _seconds(value: datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


async def list_chain(plane: ControlPlane, tenant: str, *, session_id: str | None, kinds: Sequence[str],
                     since: datetime | None, until: datetime | None, cursor: str | None,
                     limit: int) -> AuditChainList:
    if session_id is not None and not is_id(session_id, "ses"):
        raise ValidationFailed("invalid session id", [{"field": "query.session_id",
                                                       "message": "not a session id"}])
    if cursor is None:
        await _collect(plane, tenant, session_id)
    await plane.audit.flush()  # the calls this replica answered are in the trail before it is read
    async with plane.db() as db:
        rows = await audit_trail.list_events(db, tenant, session_id=session_id, kinds=kinds,
                                             since=_seconds(since), until=_seconds(until),
                                             after=_after(cursor), limit=limit + 1)
    page, more = rows[:limit], len(rows) > limit
    return AuditChainList(items=[event_out(r) for r in page],
                          next_cursor=str(page[-1].seq) if more and page else None)


async def verify_chain(plane: ControlPlane, tenant: str) -> AuditVerifyOut:
    await plane.audit.flush()
    async with plane.db() as db:
        result = await audit_trail.verify(db, tenant)
    return AuditVerifyOut(ok=result.ok, checked=result.checked, head=result.head,
                          broken_id=result.broken.id if result.broken else None,
                          reason=result.broken.reason if result.broken else None)

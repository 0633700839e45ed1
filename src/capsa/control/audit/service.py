"""What ``/v1/audit`` does: a tenant's chain, paged and filtered, and its verification. Node-side events
of the sessions concerned are collected from their nodes first, so a read sees what already happened."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select

from capsa.common.audit_checkpoint import Checkpoint, CheckpointInvalid
from capsa.common.ids import is_id
from capsa.common.wire.audit import AuditChainEvent, AuditChainList, AuditCheckpointOut, AuditVerifyOut
from capsa.control.audit import trail as audit_trail
from capsa.control.audit.checkpoints import ChainNotExtended, checkpoint_tenant
from capsa.control.egress.service import collect_audit_quietly
from capsa.control.errors import ApiError, ValidationFailed
from capsa.control.plane import ControlPlane
from capsa.control.store.audit_models import AuditTrailRow
from capsa.control.store.models import NodeRow, SessionRow

__all__ = ["checkpoint_chain", "checkpoint_out", "event_out", "list_chain", "verify_chain"]


_LIVE = ("creating", "running", "recovering")


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
        await collect_audit_quietly(plane, node)


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
    """The tenant's chain checked on its own and against every signed checkpoint of it in the anchor."""
    await plane.audit.flush()
    anchors: list[Checkpoint] = []
    if plane.checkpoints is not None:
        try:
            anchors = [c for c in await plane.checkpoints.read() if c.tenant == tenant]
        except CheckpointInvalid as exc:
            return AuditVerifyOut(ok=False, checked=0, head=0, reason=str(exc),
                                  code="audit_checkpoint_invalid")
    async with plane.db() as db:
        result = await audit_trail.verify(db, tenant, anchors)
    broken = result.broken
    return AuditVerifyOut(ok=broken is None, checked=result.checked, head=result.head,
                          broken_id=broken.id if broken else None, reason=broken.reason if broken else None,
                          code=broken.code if broken else None, anchor=result.anchor)


def checkpoint_out(checkpoint: Checkpoint) -> AuditCheckpointOut:
    return AuditCheckpointOut(n=checkpoint.n, tenant=checkpoint.tenant, seq=checkpoint.seq,
                              hash=checkpoint.hash, purpose=checkpoint.purpose, key=checkpoint.key,
                              time=datetime.fromtimestamp(checkpoint.time_us / 1_000_000, UTC))


async def checkpoint_chain(plane: ControlPlane, tenant: str) -> AuditCheckpointOut:
    """Sign the tenant's head now (its newest checkpoint when the chain has not moved since)."""
    checkpointer = plane.checkpoints
    if checkpointer is None:
        raise ApiError("audit checkpoints are not configured on this control plane (set "
                       "CAPSA_AUDIT_SIGNING_KEY_FILE)", code="audit_checkpoints_disabled", status=409)
    await plane.audit.flush()
    try:
        written = await checkpoint_tenant(plane, checkpointer, tenant)
    except ChainNotExtended as exc:
        raise ApiError(f"the audit chain does not continue its last checkpoint: {exc}",
                       code="audit_chain_broken", status=409) from None
    latest = written or await checkpointer.highest(tenant)
    if latest is None:
        latest = await checkpoint_tenant(plane, checkpointer, tenant, force=True)
    assert latest is not None
    return checkpoint_out(latest)

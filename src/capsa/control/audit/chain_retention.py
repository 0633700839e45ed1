"""Retention of the tenant audit chain (``CAPSA_AUDIT_CHAIN_RETENTION_DAYS``): the reaper drops each
tenant's oldest events, a stretch at a time, only behind a signed ``retention`` checkpoint.

For one stretch (the oldest stored events past the age, at most ``batch`` of them, never the newest event)
it first checks the stretch (linked from the previous retention checkpoint, or from 64 zeros for event 1,
each hash recomputed), then signs a ``retention`` checkpoint of its last event into the anchor outside the
database, and only then deletes it. Verification then starts at the first stored event, whose
``prev_hash`` must be the hash that checkpoint signed: the prefix is vouched for, and dropping events
without the key (or more than the checkpoint covers) is still detected. A stretch that does not check out
is kept (it is evidence) and logged.

The checkpoints must be readable by every replica that verifies: with several replicas, run the
retention on one replica until they share a sink.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import delete, func, select

from capsa.common.audit_chain import GENESIS, event_hash
from capsa.common.audit_checkpoint import Checkpoint
from capsa.control.audit.anchor import Checkpointer
from capsa.control.audit.trail import row_fields
from capsa.control.plane import ControlPlane
from capsa.control.store.audit_models import AuditHeadRow, AuditTrailRow

__all__ = ["purge_chain"]

log = logging.getLogger(__name__)


async def _drop_stretch(plane: ControlPlane, checkpointer: Checkpointer, tenant: str, head: int,
                        cutoff_us: int, dropped: list[Checkpoint], batch: int) -> int:
    async with plane.db() as db:
        first = await db.scalar(select(func.min(AuditTrailRow.seq)).where(AuditTrailRow.tenant == tenant))
        if first is None:
            return 0
        cut = await db.scalar(select(func.max(AuditTrailRow.seq)).where(
            AuditTrailRow.tenant == tenant, AuditTrailRow.seq < head, AuditTrailRow.seq < first + batch,
            AuditTrailRow.time_us < cutoff_us))
        if cut is None:
            return 0
        base = GENESIS if first == 1 else next((c.hash for c in dropped if c.seq == first - 1), None)
        if base is None:
            log.error("audit chain of tenant %s starts at event %d with no retention checkpoint before it: "
                      "kept", tenant, first)
            return 0
        rows = (await db.execute(select(AuditTrailRow).where(
            AuditTrailRow.tenant == tenant, AuditTrailRow.seq <= cut).order_by(AuditTrailRow.seq))).scalars()
        expected, prev = first, base
        for row in rows:
            if row.seq != expected or row.prev_hash != prev or event_hash(row_fields(row)) != row.hash:
                log.error("audit chain of tenant %s does not check out at event %d: not dropped", tenant,
                          expected)
                return 0
            expected, prev = row.seq + 1, row.hash
    dropped.append(await checkpointer.write(tenant, cut, prev, "retention"))
    async with plane.db() as db:
        done = await db.execute(delete(AuditTrailRow).where(AuditTrailRow.tenant == tenant,
                                                            AuditTrailRow.seq <= cut))
        await db.commit()
    return int(done.rowcount)  # type: ignore[attr-defined]  # CursorResult of a DELETE


async def purge_chain(plane: ControlPlane, batch: int = 50_000) -> int:
    """One retention pass over every tenant's chain; returns how many events it dropped."""
    days = plane.settings.audit_chain_retention_days
    checkpointer = plane.checkpoints
    if not days:
        return 0
    if checkpointer is None:
        log.warning("CAPSA_AUDIT_CHAIN_RETENTION_DAYS needs the audit signing key: the chain is kept")
        return 0
    cutoff_us = int((time.time() - days * 86400) * 1_000_000)
    async with plane.db() as db:
        heads = [(str(t), int(s)) for t, s in await db.execute(select(AuditHeadRow.tenant, AuditHeadRow.seq))]
        due = []
        for tenant, head in heads:  # the oldest stored event of each chain (its primary key's first row)
            oldest = await db.scalar(select(AuditTrailRow.time_us).where(AuditTrailRow.tenant == tenant)
                                     .order_by(AuditTrailRow.seq).limit(1))
            if oldest is not None and oldest < cutoff_us:
                due.append((tenant, head))
    if not due:
        return 0
    checkpoints = await checkpointer.read()
    deleted = 0
    for tenant, head in due:
        dropped = [c for c in checkpoints if c.tenant == tenant and c.purpose == "retention"]
        deleted += await _drop_stretch(plane, checkpointer, tenant, int(head), cutoff_us, dropped, batch)
    return deleted

"""Retention of the egress audit trail: the reaper purges events past their age and a tenant's events past
its count (``audit_retention_days``, ``audit_max_events_per_tenant``).

Safe with several replicas: every purge is a plain DELETE of rows matching a condition, so two replicas
purging at once delete each row once between them. Each pass deletes at most ``batch`` rows per rule, so a
large backlog is worked off over several passes instead of holding the database in one long statement.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, func, select

from capsa.control.plane import ControlPlane
from capsa.control.store.egress_models import AuditEventRow

__all__ = ["purge_audit"]


async def purge_audit(plane: ControlPlane, batch: int = 50_000) -> int:
    """One retention pass; returns how many events it deleted."""
    settings = plane.settings
    deleted = 0
    async with plane.db() as db:
        if settings.audit_retention_days:
            cutoff = time.time() - settings.audit_retention_days * 86400
            old = select(AuditEventRow.id).where(AuditEventRow.time < cutoff).order_by(AuditEventRow.id) \
                .limit(batch)
            done = await db.execute(delete(AuditEventRow).where(AuditEventRow.id.in_(old)))
            deleted += int(done.rowcount)  # type: ignore[attr-defined]  # CursorResult of a DELETE
        keep = settings.audit_max_events_per_tenant
        if keep:
            over = (await db.execute(select(AuditEventRow.tenant).group_by(AuditEventRow.tenant)
                                     .having(func.count() > keep))).scalars().all()
            for tenant in over:
                # The id of the newest event past the tenant's count; it and everything older go.
                last = await db.scalar(select(AuditEventRow.id).where(AuditEventRow.tenant == tenant)
                                       .order_by(AuditEventRow.id.desc()).offset(keep).limit(1))
                if last is None:
                    continue
                old = select(AuditEventRow.id).where(AuditEventRow.tenant == tenant,
                                                     AuditEventRow.id <= last) \
                    .order_by(AuditEventRow.id).limit(batch)
                done = await db.execute(delete(AuditEventRow).where(AuditEventRow.id.in_(old)))
                deleted += int(done.rowcount)  # type: ignore[attr-defined]
        await db.commit()
    return deleted

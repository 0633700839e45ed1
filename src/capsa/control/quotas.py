"""Per-tenant quotas: sessions, vCPUs and memory held at once by a tenant's sessions that have (or are
getting) a sandbox (states ``creating`` and ``running``), checked at create, branch and resume; paused
sessions, checked at pause; snapshots (count and bytes as the nodes report them), checked whenever one is
taken.

A check runs in the transaction that adds the rows (or moves a session to ``creating``), after they are
written, so what it counts includes them. On PostgreSQL a transaction-scoped advisory lock per tenant
serialises the checks of concurrent requests across replicas; on SQLite the database's single writer does.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

from sqlalchemy import func, select, text

from capsa.control.errors import ApiError
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.settings import ControlSettings
from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow, SnapshotRow

__all__ = ["QuotaExceeded", "check_paused_quota", "check_quota", "check_snapshot_quota", "lock_tenant"]


class QuotaExceeded(ApiError):
    """A tenant asked for more than its quota; closing sessions frees room (so not a retry-later 429)."""

    code, status, title = "quota_exceeded", 403, "Quota exceeded"


async def lock_tenant(db: DbSession, tenant: str) -> None:
    """Serialise quota checks of one tenant until the transaction ends (PostgreSQL; a no-op on SQLite)."""
    if db.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(f"capsa-quota:{tenant}".encode()) - (1 << 31)
        await db.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


async def check_quota(db: DbSession, settings: ControlSettings, tenant: str, *, sessions: int = 0,
                      vcpus: int = 0, memory_mib: int = 0) -> None:
    """Raise :class:`QuotaExceeded` when the tenant's active sessions, as written in this transaction, plus
    what is given (about to be asked for; an early check before costly work) exceed its quota (the caller
    rolls back)."""
    quota = settings.quota_for(tenant)
    await db.flush()
    count, used_vcpus, memory = (await db.execute(
        select(func.count(), func.coalesce(func.sum(SessionRow.vcpus), 0),
               func.coalesce(func.sum(SessionRow.memory_mib), 0))
        .where(SessionRow.tenant == tenant, SessionRow.state.in_(ACTIVE_STATES)))).one()
    over = [f"{what} {used} > {limit}" for what, used, limit in (
        ("sessions", int(count) + sessions, quota.max_sessions),
        ("vCPUs", int(used_vcpus) + vcpus, quota.max_vcpus),
        ("memory MiB", int(memory) + memory_mib, quota.max_memory_mib)) if limit and used > limit]
    if over:
        raise QuotaExceeded(f"tenant {tenant!r} is over its quota with this request ({', '.join(over)}); "
                            "close or pause sessions to make room", quota=quota.model_dump())


async def check_paused_quota(db: DbSession, settings: ControlSettings, tenant: str, *,
                             pausing: int = 0) -> None:
    """Raise :class:`QuotaExceeded` when the tenant's paused sessions plus ``pausing`` exceed its quota."""
    quota = settings.quota_for(tenant)
    if not quota.max_paused_sessions:
        return
    await db.flush()
    paused = int(await db.scalar(select(func.count()).select_from(SessionRow).where(
        SessionRow.tenant == tenant, SessionRow.state == "paused")) or 0)
    if paused + pausing > quota.max_paused_sessions:
        raise QuotaExceeded(f"tenant {tenant!r} is over its quota with this request (paused sessions "
                            f"{paused + pausing} > {quota.max_paused_sessions}); resume or close paused "
                            "sessions to make room", quota=quota.model_dump())


async def check_snapshot_quota(db: DbSession, settings: ControlSettings, tenant: str, *, snapshots: int = 0,
                               leaving: Collection[str] = ()) -> None:
    """Raise :class:`QuotaExceeded` when the tenant's snapshots as written in this transaction, plus
    ``snapshots`` more (an early check before asking a node for one), minus those in ``leaving`` (about
    to be deleted: rolling snapshots beyond their session's ``keep``), exceed its count or byte quota.
    Before a snapshot is taken its size is unknown: the byte quota then refuses only a tenant already at
    it; the check after the node has answered counts the new snapshot's bytes."""
    quota = settings.quota_for(tenant)
    if not quota.max_snapshots and not quota.max_snapshot_bytes:
        return
    await db.flush()
    query = select(func.count(), func.coalesce(func.sum(SnapshotRow.size_bytes), 0)).where(
        SnapshotRow.tenant == tenant)
    if leaving:
        query = query.where(SnapshotRow.id.not_in(list(leaving)))
    found, total = (await db.execute(query)).one()
    count, used = int(found) + snapshots, int(total or 0)
    over = []
    if quota.max_snapshots and count > quota.max_snapshots:
        over.append(f"snapshots {count} > {quota.max_snapshots}")
    if quota.max_snapshot_bytes and (used > quota.max_snapshot_bytes
                                     or (snapshots and used >= quota.max_snapshot_bytes)):
        over.append(f"snapshot bytes {used} > {quota.max_snapshot_bytes}" if used > quota.max_snapshot_bytes
                    else f"snapshot bytes {used} already at {quota.max_snapshot_bytes}")
    if over:
        raise QuotaExceeded(f"tenant {tenant!r} is over its quota with this request ({', '.join(over)}); "
                            "close sessions (their snapshots are deleted unless kept) to make room",
                            quota=quota.model_dump())

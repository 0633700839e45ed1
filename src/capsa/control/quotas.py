"""Per-tenant quotas: sessions, vCPUs and memory held at once by a tenant's sessions that have (or are
getting) a sandbox (states ``creating`` and ``running``). Checked at create, branch and resume.

The check runs in the transaction that adds the sessions (or moves one to ``creating``), after the rows are
written, so what it counts includes them. On PostgreSQL a transaction-scoped advisory lock per tenant
serialises the checks of concurrent requests across replicas; on SQLite the database's single writer does.
"""

from __future__ import annotations

import zlib

from sqlalchemy import func, select, text

from capsa.control.errors import ApiError
from capsa.control.lifecycle import ACTIVE_STATES
from capsa.control.settings import ControlSettings
from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow

__all__ = ["QuotaExceeded", "check_quota", "lock_tenant"]


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

"""Rolling snapshots: the control plane snapshots sessions by itself, so they survive losing their sandbox.

A session's policy (``rolling_snapshots``) asks for a snapshot after each command (``after_command``) and/or
every ``interval_s`` seconds in which something happened. Everything lives in the database: a finished
command sets ``snapshot_wanted_at``; each replica runs :func:`run_rolling`, which claims a due session with
a conditional update of ``snapshot_claim_until`` (a lease, so two replicas never snapshot one session at
once and a crashed replica's claim simply expires), takes the snapshot and prunes beyond ``keep``.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, update

from capsa.control.errors import ApiError
from capsa.control.plane import ControlPlane
from capsa.control.sessions.snapshots import take_snapshot
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["command_finished", "due_sessions", "rolling_once", "run_rolling"]

log = logging.getLogger(__name__)

_LEASE = timedelta(minutes=10)


async def command_finished(plane: ControlPlane, row: SessionRow) -> None:
    """A command ran to completion in the session ``row`` (as loaded for the command): sessions whose policy
    says ``after_command`` want a snapshot. Others cost no database call (the policy is fixed when the
    session is created, so the loaded row tells)."""
    if row.snapshot_keep is None or not row.snapshot_after_command:
        return
    async with plane.db() as db:
        await db.execute(update(SessionRow).where(
            SessionRow.id == row.id, SessionRow.state == "running",
            SessionRow.snapshot_keep.is_not(None), SessionRow.snapshot_after_command.is_(True),
        ).values(snapshot_wanted_at=utcnow()))
        await db.commit()


def _due(row: SessionRow, now: datetime) -> bool:
    if row.snapshot_wanted_at is not None:
        return True
    if row.snapshot_interval_s is None:
        return False
    since = row.last_snapshot_at or row.created_at
    if since + timedelta(seconds=row.snapshot_interval_s) > now:
        return False
    # Only activity is worth a new snapshot; a session without any snapshot gets its first one regardless.
    return row.last_snapshot_at is None or row.last_activity_at > row.last_snapshot_at


async def due_sessions(plane: ControlPlane) -> list[str]:
    now = utcnow()
    async with plane.db() as db:
        rows = await db.execute(select(SessionRow).where(
            SessionRow.state == "running", SessionRow.snapshot_keep.is_not(None),
            or_(SessionRow.snapshot_wanted_at.is_not(None), SessionRow.snapshot_interval_s.is_not(None)),
            or_(SessionRow.snapshot_claim_until.is_(None), SessionRow.snapshot_claim_until < now)))
        return [row.id for row in rows.scalars() if _due(row, now)]


async def _claim(plane: ControlPlane, session_id: str) -> datetime | None:
    now = utcnow()
    async with plane.db() as db:
        result = await db.execute(update(SessionRow).where(
            SessionRow.id == session_id, SessionRow.state == "running",
            or_(SessionRow.snapshot_claim_until.is_(None), SessionRow.snapshot_claim_until < now),
        ).values(snapshot_claim_until=now + _LEASE))
        await db.commit()
    return now if result.rowcount else None  # type: ignore[attr-defined]


async def _release(plane: ControlPlane, session_id: str, claimed_at: datetime, done: bool) -> None:
    async with plane.db() as db:
        await db.execute(update(SessionRow).where(SessionRow.id == session_id)
                         .values(snapshot_claim_until=None))
        if done:
            # A command that finished while the snapshot was being taken still wants the next one.
            await db.execute(update(SessionRow).where(
                SessionRow.id == session_id,
                and_(SessionRow.snapshot_wanted_at.is_not(None), SessionRow.snapshot_wanted_at <= claimed_at),
            ).values(snapshot_wanted_at=None))
        await db.commit()


async def rolling_once(plane: ControlPlane) -> list[str]:
    """One pass; returns the ids of the snapshots taken."""
    taken: list[str] = []
    for session_id in await due_sessions(plane):
        claimed_at = await _claim(plane, session_id)
        if claimed_at is None:
            continue  # another replica has it
        done = False
        try:
            snap = await take_snapshot(plane, None, session_id, kind="rolling")
            taken.append(snap.id)
            done = True
        except ApiError as exc:
            # A lost sandbox was already handled (paused at the previous snapshot, or failed).
            log.warning("rolling snapshot of %s failed: %s", session_id, exc.message)
            # Over the tenant's snapshot quota: this one is not retried until the next is due.
            done = exc.code in ("invalid_state", "session_failed", "not_found", "quota_exceeded")
        finally:
            await _release(plane, session_id, claimed_at, done)
    return taken


async def run_rolling(plane: ControlPlane) -> None:
    interval = plane.settings.rolling_snapshot_interval
    while True:
        try:
            await rolling_once(plane)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rolling snapshot pass failed; retrying next interval")
        await asyncio.sleep(interval)

"""Session lifecycle decisions: create (with placement), look up within a tenant, close, fail, expire."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, or_, select, update

from capsa.common.ids import new_id
from capsa.control.audit import trail as audit_trail
from capsa.control.auth import Principal
from capsa.control.egress import grants as egress_grants
from capsa.control.egress import service as egress
from capsa.control.errors import ApiError, InvalidState, NoCapacity, SessionFailed, ValidationFailed
from capsa.control.metrics import timed
from capsa.control.nodes.calls import attempt, quietly
from capsa.control.nodes.client import EgressArgs, NodeClient, NodeError
from capsa.control.nodes.placement import choose_node
from capsa.control.plane import ControlPlane
from capsa.control.quotas import check_quota, lock_tenant
from capsa.control.schemas import RollingSnapshots, SessionCreate, SessionList, SessionOut
from capsa.control.sessions.rows import load_session
from capsa.control.sessions.states import transition
from capsa.control.store.db import DbSession
from capsa.control.store.models import (
    NodeRow,
    PortTokenRow,
    SessionMetadataRow,
    SessionRow,
    SnapshotRow,
    utcnow,
)

__all__ = [
    "activity_stale",
    "close_session",
    "create_session",
    "destroy_quietly",
    "extend_session",
    "fail_session",
    "finish_session",
    "get_session",
    "list_sessions",
    "lose_sandbox",
    "node_of",
    "purge_snapshots",
    "runs_on",
    "sessions_to_expire",
    "stamp_interval",
    "to_out",
]

log = logging.getLogger(__name__)


def _policy(row: SessionRow) -> RollingSnapshots | None:
    if row.snapshot_keep is None:
        return None
    return RollingSnapshots(interval_s=row.snapshot_interval_s, after_command=row.snapshot_after_command,
                            keep=row.snapshot_keep, max_age_s=row.snapshot_max_age_s)


def to_out(row: SessionRow, metadata: Mapping[str, str]) -> SessionOut:
    return SessionOut(
        id=row.id, tenant=row.tenant, state=row.state,
        template=row.template, created_at=row.created_at, updated_at=row.updated_at,
        expires_at=row.expires_at, idle_timeout=row.idle_timeout, last_activity_at=row.last_activity_at,
        metadata=dict(metadata), memory_mib=row.memory_mib, vcpus=row.vcpus, node_id=row.node_id,
        failure_reason=row.failure_reason, closed_at=row.closed_at,
        on_timeout="pause" if row.on_timeout == "pause" else "close", rolling_snapshots=_policy(row),
        keep_snapshots=bool(row.keep_snapshots), pause_reason=row.pause_reason,
        expose=list(row.expose) if row.expose is not None else None,
    )


async def _metadata(db: DbSession, session_ids: list[str]) -> dict[str, dict[str, str]]:
    result: dict[str, dict[str, str]] = {sid: {} for sid in session_ids}
    if session_ids:
        rows = await db.execute(
            select(SessionMetadataRow).where(SessionMetadataRow.session_id.in_(session_ids)))
        for meta in rows.scalars():
            result[meta.session_id][meta.key] = meta.value
    return result



async def get_session(plane: ControlPlane, tenant: str, session_id: str) -> SessionOut:
    async with plane.db() as db:
        row = await load_session(db, tenant, session_id)
        return to_out(row, (await _metadata(db, [row.id]))[row.id])


def _encode_cursor(row: SessionRow) -> str:
    raw = json.dumps([row.created_at.isoformat(), row.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, sid = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        when = datetime.fromisoformat(created)
        if not isinstance(sid, str) or when.tzinfo is None:
            raise ValueError
        return when, sid
    except (ValueError, TypeError) as exc:
        raise ValidationFailed("invalid cursor", [{"field": "query.cursor", "message": "invalid cursor"}]) \
            from exc


async def list_sessions(plane: ControlPlane, tenant: str, state: str | Collection[str] | None,
                        metadata: Mapping[str, str], limit: int, cursor: str | None) -> SessionList:
    """A page of the tenant's sessions, newest first; ``state``: one state or any of several."""
    query = select(SessionRow).where(SessionRow.tenant == tenant)
    if isinstance(state, str):
        query = query.where(SessionRow.state == state)
    elif state is not None:
        query = query.where(SessionRow.state.in_(list(state)))
    for key, value in metadata.items():
        query = query.where(SessionRow.id.in_(
            select(SessionMetadataRow.session_id).where(SessionMetadataRow.key == key,
                                                        SessionMetadataRow.value == value)))
    if cursor:
        created, sid = _decode_cursor(cursor)
        query = query.where(or_(SessionRow.created_at < created,
                                and_(SessionRow.created_at == created, SessionRow.id < sid)))
    query = query.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()).limit(limit + 1)
    async with plane.db() as db:
        rows = list((await db.execute(query)).scalars())
        page, more = rows[:limit], len(rows) > limit
        meta = await _metadata(db, [r.id for r in page])
    return SessionList(items=[to_out(r, meta[r.id]) for r in page],
                       next_cursor=_encode_cursor(page[-1]) if more and page else None)


@timed("create")
async def create_session(plane: ControlPlane, principal: Principal, req: SessionCreate) -> SessionOut:
    now = utcnow()
    session_id, sandbox_id = new_id("ses"), new_id("sbx")
    policy: dict[str, Any] | None = None
    secret_values: dict[str, str] = {}
    placeholders: dict[str, str] = {}
    if req.policy is not None:
        policy, secret_values = await egress.resolve_policy(plane, principal.tenant, req.policy)
        await egress_grants.check_policy_networks(plane, principal.tenant, policy)
        placeholders = egress.assign_placeholders(policy)
    async with plane.db() as db:
        await lock_tenant(db, principal.tenant)
        node = await choose_node(db, req.template, req.memory_mib, req.vcpus,
                                 plane.settings.node_heartbeat_timeout, egress=policy is not None)
        row = SessionRow(
            id=session_id, tenant=principal.tenant, state="creating", template=req.template, created_at=now,
            updated_at=now, expires_at=now + timedelta(seconds=req.timeout), idle_timeout=req.idle_timeout,
            last_activity_at=now, memory_mib=req.memory_mib, vcpus=req.vcpus, node_id=node.id,
            sandbox_id=sandbox_id, timeout_s=req.timeout, on_timeout=req.on_timeout,
            keep_snapshots=req.keep_snapshots, env=dict(req.env) or None,
            expose=sorted(set(req.expose)) if req.expose is not None else None,
        )
        if req.rolling_snapshots is not None:
            row.snapshot_keep = req.rolling_snapshots.keep
            row.snapshot_interval_s = req.rolling_snapshots.interval_s
            row.snapshot_after_command = req.rolling_snapshots.after_command
            row.snapshot_max_age_s = req.rolling_snapshots.max_age_s
        db.add(row)
        await db.flush()  # the metadata rows reference the session row
        db.add_all(SessionMetadataRow(session_id=session_id, key=k, value=v) for k, v in req.metadata.items())
        if policy is not None:
            egress.store_policy(db, session_id, policy, placeholders)
        await check_quota(db, plane.settings, principal.tenant)
        await db.commit()
    try:
        args = (EgressArgs(policy, secret_values, placeholders, session_id,
                           await egress_grants.tenant_networks(plane, principal.tenant))
                if policy is not None else None)
        node = await _start_sandbox(plane, principal.tenant, req, row, sandbox_id, node, args)
    except NoCapacity:
        raise  # no node had room: the session was never made (see _start_sandbox)
    except BaseException as exc:
        # Nothing may stay half-created: the node cleans up a failed boot itself, and we ask it again in
        # case the failure was on the way back (or this request was cancelled while it booted).
        reason = f"{exc.code}: {exc.message}" if isinstance(exc, NodeError) else f"{type(exc).__name__}"
        await fail_session(plane, session_id, f"sandbox could not be started ({reason})")
        if isinstance(exc, NodeError):
            raise SessionFailed(f"session {session_id} failed to start: {exc.message}",
                                session_id=session_id) from exc
        raise
    client = plane.node_client(node)
    async with plane.db() as db:
        running_since = utcnow()
        started = await transition(db, session_id, "running", updated_at=running_since)
        await db.commit()
        if started:
            # The row as written (no second read): only the state and its time changed since.
            row.state, row.updated_at = "running", running_since
            plane.sessions.store(row, node)  # its first command needs no read either
            return to_out(row, dict(req.metadata))
        # Closed (or reaped) while the VM was booting: the VM must not outlive the decision.
        await destroy_quietly(client, sandbox_id)
        row = await load_session(db, principal.tenant, session_id)
        return to_out(row, (await _metadata(db, [row.id]))[row.id])


async def _start_sandbox(plane: ControlPlane, tenant: str, req: SessionCreate, row: SessionRow,
                         sandbox_id: str, node: NodeRow, args: EgressArgs | None) -> NodeRow:
    """Make the session's sandbox on ``node``; the node it runs on. A node that refuses it for want of room
    (``no_capacity``: it is short of memory, whatever its declared figures said) passes it to the next one
    placement chooses; when none is left the session is removed, as if placement had refused it at first,
    and ``NoCapacity`` raised."""
    tried: list[str] = []
    while True:
        made = await attempt(plane.node_client(node).create_sandbox(
            sandbox_id, req.template, req.memory_mib, req.vcpus, req.env, egress=args, tenant=tenant))
        if not isinstance(made, NodeError):
            return node
        if made.code != "no_capacity":
            raise made
        tried.append(node.id)
        async with plane.db() as db:
            try:
                node = await choose_node(db, req.template, req.memory_mib, req.vcpus,
                                         plane.settings.node_heartbeat_timeout, egress=args is not None,
                                         exclude=tried)
            except ApiError:
                await db.execute(delete(SessionRow).where(SessionRow.id == row.id))
                await db.commit()
                raise NoCapacity(f"no node has room for the session: {made.message}") from None
            await db.execute(update(SessionRow).where(SessionRow.id == row.id).values(node_id=node.id))
            await db.commit()
        row.node_id = node.id


async def destroy_quietly(client: NodeClient, sandbox_id: str) -> None:
    """Destroy the sandbox; a failure is logged and left for the heartbeat reconciliation, which destroys
    sandboxes that no active session owns."""
    await quietly(client.destroy_sandbox(sandbox_id), f"could not destroy sandbox {sandbox_id}")


async def node_of(db: DbSession, row: SessionRow) -> NodeRow | None:
    return await db.get(NodeRow, row.node_id) if row.node_id else None


async def finish_session(plane: ControlPlane, session_id: str, target: str, reason: str | None) -> bool:
    async with plane.db() as db:
        fields = {"failure_reason": reason} if reason is not None else {}
        done = await transition(db, session_id, target, **fields)
        plane.sessions.forget(session_id)
        if done:  # the session's port tokens die with it
            await db.execute(delete(PortTokenRow).where(PortTokenRow.session_id == session_id))
        # Read what to destroy before committing, so the sandbox is gone as soon after the state
        # change becomes visible as possible.
        row = await db.get(SessionRow, session_id, populate_existing=True) if done else None
        if row is not None:  # in the same transaction as the state change: recorded iff it happened
            await audit_trail.record(db, tenant=row.tenant, kind="session",
                                     action="close" if target == "closed" else "fail",
                                     session_id=session_id, detail={"state": target, "reason": reason})
        node = await node_of(db, row) if row else None
        await db.commit()
        if not done:
            return False
    if row is not None and node is not None and row.sandbox_id:
        await destroy_quietly(plane.node_client(node), row.sandbox_id)
        await egress.collect_audit_quietly(plane, node)  # the sandbox's last events, incl. its teardown
    await purge_snapshots(plane, session_id)
    return True


async def purge_snapshots(plane: ControlPlane, session_id: str | None = None) -> list[str]:
    """Delete the snapshots of ended sessions (all, or one session's) unless the session keeps them, and
    those ``keep_snapshots`` kept for longer than ``keep_snapshots_days`` after the session ended.

    A snapshot whose node cannot be reached keeps its record, so a later pass (the reaper) retries.
    """
    unkept: ColumnElement[bool] = SessionRow.keep_snapshots.is_(False)
    if plane.settings.keep_snapshots_days:
        expired = utcnow() - timedelta(days=plane.settings.keep_snapshots_days)
        unkept = or_(unkept, SessionRow.closed_at < expired)
    query = (select(SnapshotRow, NodeRow).join(SessionRow, SessionRow.id == SnapshotRow.session_id)
             .join(NodeRow, NodeRow.id == SnapshotRow.node_id, isouter=True)
             .where(SessionRow.state.in_(("closed", "failed")), unkept))
    if session_id is not None:
        query = query.where(SnapshotRow.session_id == session_id)
    async with plane.db() as db:
        found = list((await db.execute(query)).all())
    deleted: list[str] = []
    for snap, node in found:
        if node is not None and not await quietly(plane.node_client(node).delete_snapshot(snap.id),
                                                  f"could not delete snapshot {snap.id}",
                                                  fine=("snapshot_not_found",)):
            continue
        async with plane.db() as db:
            await db.execute(delete(SnapshotRow).where(SnapshotRow.id == snap.id))
            await db.commit()
        deleted.append(snap.id)
    return deleted


async def lose_sandbox(plane: ControlPlane, session_id: str, reason: str,
                       sandbox_id: str | None = None, *, why: str | None = None) -> str:
    """The session's sandbox is gone (VM died, node lost). With a snapshot to come back to, the session is
    paused and can be resumed from it; without one it fails with ``reason``. Returns the session's
    resulting state.

    ``sandbox_id``: the sandbox found gone; if the session has moved to another one since (a restore), the
    session is left alone. ``why``: how the loss was noticed, for the pause reason and the log (default
    ``reason``).
    """
    why = why or reason
    async with plane.db() as db:
        row = await db.get(SessionRow, session_id, populate_existing=True)
        if row is None or row.state != "running" or (sandbox_id is not None and row.sandbox_id != sandbox_id):
            return row.state if row is not None else "failed"
        latest = (await db.execute(select(SnapshotRow.id).where(SnapshotRow.session_id == session_id)
                                   .order_by(SnapshotRow.created_at.desc()).limit(1))).scalar_one_or_none()
        sandbox_id, node = row.sandbox_id, await node_of(db, row)
        paused = latest is not None and await transition(
            db, session_id, "paused", sources=("running",), sandbox_id=None,
            pause_reason=f"sandbox lost ({why}); resume continues from snapshot {latest}")
        plane.sessions.forget(session_id)
        await db.commit()
    if latest is None:
        if await fail_session(plane, session_id, reason):
            plane.metrics.sandbox_losses.labels("failed").inc()
        return "failed"
    if not paused:
        # Someone else changed the session first (a second heartbeat or replica handling the same loss,
        # a close): what they did stands; failing it here would undo a pause that just happened.
        async with plane.db() as db:
            now = await db.get(SessionRow, session_id, populate_existing=True)
            return now.state if now is not None else "failed"
    plane.metrics.sandbox_losses.labels("paused").inc()
    if node is not None and sandbox_id:
        await destroy_quietly(plane.node_client(node), sandbox_id)
    log.warning("session %s lost its sandbox (%s); paused at snapshot %s", session_id, why, latest)
    return "paused"


async def fail_session(plane: ControlPlane, session_id: str, reason: str) -> bool:
    """Mark a session failed and destroy whatever is left of its sandbox."""
    return await finish_session(plane, session_id, "failed", reason)


async def close_session(plane: ControlPlane, tenant: str, session_id: str,
                        reason: str | None = None) -> SessionOut:
    async with plane.db() as db:
        await load_session(db, tenant, session_id)
    await finish_session(plane, session_id, "closed", reason)
    return await get_session(plane, tenant, session_id)


async def runs_on(plane: ControlPlane, session_id: str, sandbox_id: str) -> bool:
    """Whether the session still runs on the sandbox ``sandbox_id`` (read now, not from the cache)."""
    async with plane.db() as db:
        row = await db.get(SessionRow, session_id, populate_existing=True)
    return row is not None and row.state == "running" and row.sandbox_id == sandbox_id


async def extend_session(plane: ControlPlane, tenant: str, session_id: str, ttl: int) -> SessionOut:
    async with plane.db() as db:
        row = await load_session(db, tenant, session_id)
        if row.state not in ("creating", "running", "paused"):
            raise InvalidState(f"session {session_id} is {row.state}")
        now = utcnow()
        await db.execute(update(SessionRow).where(SessionRow.id == session_id)
                         .values(expires_at=now + timedelta(seconds=ttl), updated_at=now))
        await db.commit()
    return await get_session(plane, tenant, session_id)


def stamp_interval(idle_timeout: int | None, interval: float) -> float:
    """How stale a session's ``last_activity_at`` may be: ``interval`` (the setting), at most a quarter of
    its idle timeout."""
    return interval if idle_timeout is None else min(interval, idle_timeout / 4)


def activity_stale(row: SessionRow, now: datetime, interval: float) -> bool:
    """Whether a call now must write the session's activity stamp: it is older than the allowed staleness,
    or not newer than the latest snapshot (rolling snapshots by interval only follow activity after it)."""
    last = row.last_activity_at
    if row.last_snapshot_at is not None and last <= row.last_snapshot_at:
        return True
    return (now - last).total_seconds() >= stamp_interval(row.idle_timeout, interval)


async def sessions_to_expire(db: DbSession, stamp_every: float = 0.0) -> list[tuple[str, str]]:
    """(session id, reason) of sessions past their hard TTL or idle timeout. ``stamp_every``: the
    ``activity_stamp_interval`` the replicas write activity stamps with; a session counts as idle only
    once its stamp is older than its idle timeout plus that staleness (:func:`stamp_interval`), so a
    session in use is never closed as idle."""
    now = utcnow()
    rows = await db.execute(
        select(SessionRow.id, SessionRow.expires_at, SessionRow.idle_timeout, SessionRow.last_activity_at)
        .where(or_(SessionRow.state == "running",
                   # a session paused because of on_timeout=pause waits for its owner, not for the reaper
                   and_(SessionRow.state == "paused", SessionRow.on_timeout != "pause")),
               or_(SessionRow.expires_at <= now, SessionRow.idle_timeout.is_not(None)))
    )
    due: list[tuple[str, str]] = []
    for sid, expires_at, idle, last in rows.all():
        if expires_at <= now:
            due.append((sid, "timeout"))
        elif idle is not None and last + timedelta(seconds=idle + stamp_interval(idle, stamp_every)) <= now:
            due.append((sid, "idle_timeout"))
    return due


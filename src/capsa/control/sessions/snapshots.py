"""Sessions that outlive sandboxes: pause, resume, branch, snapshots, restore (docs/api-contract.md).

A session's snapshots are rows in ``snapshots`` (tenant scoped) and files on the node that took them.
Every snapshot the control plane asks for is ``retain: true`` on the node, so it outlives the sandbox it
was taken of; the control plane deletes it (rolling retention, or when the session ends).

Starting a sandbox for an existing session (resume, restore) moves the session to ``creating`` with the new
sandbox id first, so placement counts it and heartbeat reconciliation does not destroy it mid-restore; a
failure moves it back (``paused``, or ``running`` on its old sandbox for a restore) — nothing is lost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta

from sqlalchemy import func, select

from capsa.common.ids import is_id, new_id
from capsa.common.node_api import SnapshotInfo
from capsa.control.egress import service as egress
from capsa.control.errors import ApiError, InvalidState, SessionFailed
from capsa.control.metrics import timed
from capsa.control.nodes.calls import node_error, quietly
from capsa.control.nodes.client import NodeClient, NodeError
from capsa.control.nodes.placement import choose_snapshot_node
from capsa.control.plane import ControlPlane
from capsa.control.quotas import (
    QuotaExceeded,
    check_paused_quota,
    check_quota,
    check_snapshot_quota,
    lock_tenant,
)
from capsa.control.schemas import BranchOut, SessionOut, SnapshotList, SnapshotOut
from capsa.control.sessions.relay import call, running
from capsa.control.sessions.rows import load_session
from capsa.control.sessions.service import destroy_quietly, fail_session, finish_session, get_session, to_out
from capsa.control.sessions.states import transition
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow, SessionMetadataRow, SessionRow, SnapshotRow, utcnow

__all__ = [
    "BRANCHED_FROM",
    "SnapshotNotFound",
    "back_running",
    "branch_session",
    "latest_snapshot",
    "list_snapshots",
    "pause_session",
    "prune_aged_rolling",
    "prune_rolling",
    "reap_to_pause",
    "restore_onto",
    "restore_session",
    "resume_session",
    "snapshot_out",
    "take_snapshot",
]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = 3600
BRANCHED_FROM = "branched_from"


class SnapshotNotFound(ApiError):
    code, status, title = "snapshot_not_found", 404, "Snapshot not found"


def snapshot_out(row: SnapshotRow) -> SnapshotOut:
    return SnapshotOut(id=row.id, session_id=row.session_id, kind=row.kind,
                       created_at=row.created_at, size_bytes=row.size_bytes, parent=row.parent,
                       node_id=row.node_id, stored=row.stored)



def _state_error(row: SessionRow, wanted: str) -> ApiError:
    if row.state == "failed":
        return SessionFailed(f"session {row.id} failed: {row.failure_reason}")
    return InvalidState(f"session {row.id} is {row.state}, not {wanted}")


async def latest_snapshot(db: DbSession, session_id: str, *, stored: bool = False) -> SnapshotRow | None:
    """The session's newest snapshot (``stored``: of those in the fleet's store)."""
    query = select(SnapshotRow).where(SnapshotRow.session_id == session_id)
    if stored:
        query = query.where(SnapshotRow.stored.is_(True))
    result = await db.execute(query.order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc()).limit(1))
    return result.scalar_one_or_none()


async def list_snapshots(plane: ControlPlane, tenant: str, session_id: str) -> SnapshotList:
    async with plane.db() as db:
        await load_session(db, tenant, session_id)
        rows = await db.execute(select(SnapshotRow).where(SnapshotRow.session_id == session_id,
                                                          SnapshotRow.tenant == tenant)
                                .order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc()))
        return SnapshotList(items=[snapshot_out(r) for r in rows.scalars()])


def _record(row: SessionRow, snap: SnapshotInfo, kind: str) -> SnapshotRow:
    assert row.node_id is not None  # a running session's
    return SnapshotRow(id=snap.id, tenant=row.tenant, session_id=row.id, node_id=row.node_id,
                       sandbox_id=row.sandbox_id, kind=kind, created_at=utcnow(), size_bytes=snap.size_bytes,
                       parent=snap.parent, stored=snap.stored)


async def _delete_on_node(client: NodeClient, snapshot_id: str) -> bool:
    return await quietly(client.delete_snapshot(snapshot_id), f"could not delete snapshot {snapshot_id}",
                         fine=("snapshot_not_found",))


async def _rolling_beyond(db: DbSession, session_id: str, keep: int | None) -> list[str]:
    """The session's rolling snapshots past the newest ``keep`` (what :func:`prune_rolling` deletes)."""
    if keep is None:
        return []
    return list((await db.execute(
        select(SnapshotRow.id).where(SnapshotRow.session_id == session_id, SnapshotRow.kind == "rolling")
        .order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc()).offset(keep))).scalars())


async def take_snapshot(plane: ControlPlane, tenant: str | None, session_id: str,
                        kind: str = "manual") -> SnapshotOut:
    """Snapshot the running session now; the sandbox keeps running. ``tenant=None``: internal callers.

    Within the tenant's snapshot quota (``quota_exceeded``): checked before the node is asked (count, and
    a tenant already at its bytes), and again with the snapshot's size once the node has taken it; a
    snapshot refused then is deleted from the node and never recorded. A rolling snapshot counts without
    those it makes :func:`prune_rolling` delete."""
    target = await running(plane, tenant, session_id, activity=False)
    row, client = target.row, target.client
    rolling_keep = row.snapshot_keep if kind == "rolling" else None
    async with plane.db() as db:
        leaving = await _rolling_beyond(db, session_id, None if rolling_keep is None else rolling_keep - 1)
        await check_snapshot_quota(db, plane.settings, row.tenant, snapshots=1, leaving=leaving)
    snap = await call(target, lambda node, sandbox: node.snapshot_sandbox(
        sandbox, retain=True, labels={"session": row.id, "kind": kind}, tenant=row.tenant))
    async with plane.db() as db:
        await lock_tenant(db, row.tenant)
        current = await db.get(SessionRow, session_id, populate_existing=True)
        if current is None or current.state != "running" or current.sandbox_id != row.sandbox_id:
            # Closed, paused or swapped while the snapshot was taken: it belongs to nothing now.
            await _delete_on_node(client, snap.id)
            raise InvalidState(f"session {session_id} changed state while it was snapshotted")
        record = _record(row, snap, kind)
        db.add(record)
        current.last_snapshot_at = record.created_at
        try:
            await check_snapshot_quota(db, plane.settings, row.tenant,
                                       leaving=await _rolling_beyond(db, session_id, rolling_keep))
        except QuotaExceeded:
            await db.rollback()
            await _delete_on_node(client, snap.id)
            raise
        await db.commit()
        out = snapshot_out(record)
    if kind == "rolling":
        await prune_rolling(plane, session_id)
    return out


async def prune_rolling(plane: ControlPlane, session_id: str) -> list[str]:
    """Delete rolling snapshots beyond the session's ``keep`` and those older than its ``max_age_s`` but the
    newest (oldest first); returns the deleted ids."""
    async with plane.db() as db:
        row = await db.get(SessionRow, session_id, populate_existing=True)
        if row is None or row.snapshot_keep is None:
            return []
        rows = await db.execute(select(SnapshotRow, NodeRow).join(NodeRow, NodeRow.id == SnapshotRow.node_id)
                                .where(SnapshotRow.session_id == session_id, SnapshotRow.kind == "rolling")
                                .order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc()))
        ordered = list(rows.all())
        cutoff = (utcnow() - timedelta(seconds=row.snapshot_max_age_s)
                  if row.snapshot_max_age_s is not None else None)
        extra = [(snap, node) for i, (snap, node) in enumerate(ordered)
                 if i >= row.snapshot_keep or (i > 0 and cutoff is not None and snap.created_at < cutoff)]
        extra.reverse()
    deleted: list[str] = []
    for snap, node in extra:
        if await _delete_on_node(plane.node_client(node), snap.id):
            async with plane.db() as db:
                gone = await db.get(SnapshotRow, snap.id)
                if gone is not None:
                    await db.delete(gone)
                    await db.commit()
            deleted.append(snap.id)
    return deleted


async def prune_aged_rolling(plane: ControlPlane) -> list[str]:
    """The reaper's pass for rolling snapshots that aged out while no new one was taken (an idle session):
    :func:`prune_rolling` of each session with a ``max_age_s`` that has more than one rolling snapshot and
    one older than that; returns the deleted ids."""
    async with plane.db() as db:
        rows = await db.execute(
            select(SessionRow.id, SessionRow.snapshot_max_age_s, func.min(SnapshotRow.created_at),
                   func.count())
            .join(SnapshotRow, SnapshotRow.session_id == SessionRow.id)
            .where(SessionRow.snapshot_max_age_s.is_not(None), SnapshotRow.kind == "rolling")
            .group_by(SessionRow.id, SessionRow.snapshot_max_age_s))
        now = utcnow()
        due = [sid for sid, max_age, oldest, count in rows.all()
               if count > 1 and oldest < now - timedelta(seconds=max_age or 0)]
    deleted: list[str] = []
    for sid in due:
        deleted += await prune_rolling(plane, sid)
    return deleted


@timed("pause")
async def pause_session(plane: ControlPlane, tenant: str | None, session_id: str,
                        reason: str = "paused") -> SessionOut:
    """Snapshot the session and destroy its sandbox; it keeps only the snapshot until it is resumed.

    Within the tenant's paused-session and snapshot quotas (``quota_exceeded``), checked before the node
    is asked: once it answers the sandbox is gone, so the pause snapshot's bytes are counted after it
    (a pause can take a tenant past its byte quota by that one snapshot; its next ones are refused), and
    pauses in flight at once can pass the paused-session check together (at most the tenant's running
    sessions)."""
    target = await running(plane, tenant, session_id, activity=False)
    row, client = target.row, target.client
    async with plane.db() as db:
        await check_paused_quota(db, plane.settings, row.tenant, pausing=1)
        await check_snapshot_quota(db, plane.settings, row.tenant, snapshots=1)
    snap = await call(target, lambda node, sandbox: node.pause_sandbox(
        sandbox, labels={"session": row.id, "kind": "pause"}, tenant=row.tenant))
    async with plane.db() as db:
        record = _record(row, snap, "pause")
        paused = await transition(db, session_id, "paused", sources=("running",), sandbox_id=None,
                                  pause_reason=reason, last_snapshot_at=record.created_at)
        plane.sessions.forget(session_id)
        if paused:
            db.add(record)
        await db.commit()
    if not paused:
        await _delete_on_node(client, record.id)
        async with plane.db() as db:
            raise _state_error(await load_session(db, row.tenant, session_id), "running")
    return await get_session(plane, row.tenant, session_id)


async def _own_snapshot(db: DbSession, row: SessionRow, snapshot_id: str | None) -> SnapshotRow:
    if snapshot_id is None:
        snap = await latest_snapshot(db, row.id)
        if snap is None:
            raise InvalidState(f"session {row.id} has no snapshot to resume from")
        return snap
    snap = await db.get(SnapshotRow, snapshot_id) if is_id(snapshot_id, "snap") else None
    if snap is None or snap.session_id != row.id or snap.tenant != row.tenant:
        raise SnapshotNotFound(f"snapshot {snapshot_id} not found in session {row.id}")
    return snap


@timed("resume")
async def resume_session(plane: ControlPlane, tenant: str, session_id: str,
                         snapshot_id: str | None = None) -> SessionOut:
    """A new sandbox for a paused session, from its latest snapshot (or ``snapshot_id``)."""
    return await _resume(plane, tenant, session_id, snapshot_id)


async def _resume(plane: ControlPlane, tenant: str, session_id: str, snapshot_id: str | None) -> SessionOut:
    sandbox_id = new_id("sbx")
    async with plane.db() as db:
        await lock_tenant(db, tenant)
        row = await load_session(db, tenant, session_id)
        if row.state != "paused":
            raise _state_error(row, "paused")
        snap = await _own_snapshot(db, row, snapshot_id)
        node = await choose_snapshot_node(db, snap, row.memory_mib, row.vcpus,
                                          plane.settings.node_heartbeat_timeout)
        plane.sessions.forget(session_id)  # an entry from before a pause through another replica
        if not await transition(db, session_id, "creating", sources=("paused",), node_id=node.id,
                                sandbox_id=sandbox_id):
            raise _state_error(await load_session(db, tenant, session_id), "paused")
        await check_quota(db, plane.settings, tenant)  # the session holds a sandbox again
        await db.commit()
        pause_reason = row.pause_reason
    client = plane.node_client(node)

    async def back_to_paused(db: DbSession) -> None:
        await transition(db, session_id, "paused", sources=("creating",), sandbox_id=None,
                         node_id=snap.node_id, pause_reason=pause_reason)

    await restore_onto(plane, client, row, snap, sandbox_id, undo=back_to_paused, what="resumed")
    return await _started(plane, tenant, session_id, sandbox_id, client)


async def restore_onto(plane: ControlPlane, client: NodeClient, row: SessionRow, snap: SnapshotRow,
                        sandbox_id: str, *, undo: Callable[[DbSession], Awaitable[None]], what: str) -> None:
    """Restore ``snap`` as the session's new sandbox ``sandbox_id`` on ``client``'s node, with the session's
    egress as recorded now (a policy changed while paused applies from here on). On failure the session
    goes back where it was (``undo``, committed) and the half-made sandbox is destroyed."""
    try:
        args = await egress.session_egress(plane, row.tenant, row.id)
        await client.restore_snapshot(snap.id, sandbox_id, row.env or {}, egress=args)
    except BaseException as exc:
        async with plane.db() as db:
            await undo(db)
            await db.commit()
        await destroy_quietly(client, sandbox_id)
        if isinstance(exc, NodeError):
            raise node_error(exc, f"session {row.id} could not be {what}") from exc
        raise


async def back_running(db: DbSession, session_id: str, source: str) -> bool:
    """A new sandbox of the session runs: ``source`` -> ``running`` with a fresh lifetime (its original
    ``timeout``), in the caller's transaction; False when the session left ``source`` meanwhile."""
    now = utcnow()
    row = await db.get(SessionRow, session_id, populate_existing=True)
    assert row is not None
    lifetime = timedelta(seconds=row.timeout_s or _DEFAULT_TIMEOUT)
    return await transition(db, session_id, "running", sources=(source,), pause_reason=None,
                            expires_at=now + lifetime, last_activity_at=now)


async def _started(plane: ControlPlane, tenant: str, session_id: str, sandbox_id: str,
                   client: NodeClient) -> SessionOut:
    """The new sandbox runs: the session is ``running`` again with a fresh lifetime."""
    async with plane.db() as db:
        started = await back_running(db, session_id, "creating")
        await db.commit()
    if not started:
        # Closed while the sandbox was starting: the sandbox must not outlive that decision.
        await destroy_quietly(client, sandbox_id)
    return await get_session(plane, tenant, session_id)


@timed("restore")
async def restore_session(plane: ControlPlane, tenant: str, session_id: str, snapshot_id: str) -> SessionOut:
    """Roll the session back to one of its snapshots: a new sandbox from it replaces the current one."""
    async with plane.db() as db:
        row = await load_session(db, tenant, session_id)
        if row.state not in ("running", "paused"):
            raise _state_error(row, "running or paused")
        snap = await _own_snapshot(db, row, snapshot_id)
    if row.state == "paused":
        return await _resume(plane, tenant, session_id, snapshot_id)
    sandbox_id = new_id("sbx")
    async with plane.db() as db:
        old_sandbox, old_node_id = row.sandbox_id, row.node_id
        node = await choose_snapshot_node(db, snap, row.memory_mib, row.vcpus,
                                          plane.settings.node_heartbeat_timeout)
        plane.sessions.forget(session_id)
        if not await transition(db, session_id, "creating", sources=("running",), node_id=node.id,
                                sandbox_id=sandbox_id):
            raise _state_error(await load_session(db, tenant, session_id), "running")
        await db.commit()
        old_node = await db.get(NodeRow, old_node_id) if old_node_id else None
    client = plane.node_client(node)

    async def back_to_its_sandbox(db: DbSession) -> None:  # a failed restore changes nothing
        await transition(db, session_id, "running", sources=("creating",), sandbox_id=old_sandbox,
                         node_id=old_node_id)

    await restore_onto(plane, client, row, snap, sandbox_id, undo=back_to_its_sandbox, what="restored")
    if old_node is not None and old_sandbox:
        await destroy_quietly(plane.node_client(old_node), old_sandbox)
    return await _started(plane, tenant, session_id, sandbox_id, client)


@timed("branch")
async def branch_session(plane: ControlPlane, tenant: str, session_id: str, n: int) -> BranchOut:
    """``n`` new sessions (same tenant, copied metadata + ``branched_from``) from the session's state now:
    a fresh snapshot of a running session, or the latest snapshot of a paused one."""
    async with plane.db() as db:
        row = await load_session(db, tenant, session_id)
        if row.state not in ("running", "paused"):
            raise _state_error(row, "running or paused")
        # Before the snapshot: a branch the quota refuses must not cost one.
        await check_quota(db, plane.settings, tenant, sessions=n, vcpus=n * row.vcpus,
                          memory_mib=n * row.memory_mib)
    # Each branch starts under a copy of the parent's policy and placeholders (those in its memory).
    parent_egress = await egress.session_egress(plane, tenant, session_id)
    if row.state == "running":
        snap_id = (await take_snapshot(plane, tenant, session_id, kind="branch")).id
    async with plane.db() as db:
        if row.state == "paused":
            latest = await latest_snapshot(db, session_id)
            if latest is None:
                raise InvalidState(f"session {session_id} has no snapshot to branch from")
            snap_id = latest.id
        await lock_tenant(db, tenant)
        snap = await db.get(SnapshotRow, snap_id)
        assert snap is not None
        node = await choose_snapshot_node(db, snap, row.memory_mib, row.vcpus,
                                          plane.settings.node_heartbeat_timeout, count=n)
        metadata = {m.key: m.value for m in (await db.execute(
            select(SessionMetadataRow).where(SessionMetadataRow.session_id == session_id))).scalars()}
        metadata[BRANCHED_FROM] = session_id
        now = utcnow()
        lifetime = timedelta(seconds=row.timeout_s or _DEFAULT_TIMEOUT)
        children: list[tuple[str, str]] = [(new_id("ses"), new_id("sbx")) for _ in range(n)]
        for child_id, sandbox_id in children:
            db.add(SessionRow(
                id=child_id, tenant=row.tenant, state="creating", template=row.template, created_at=now,
                updated_at=now, expires_at=now + lifetime, idle_timeout=row.idle_timeout,
                last_activity_at=now, memory_mib=row.memory_mib, vcpus=row.vcpus, node_id=node.id,
                sandbox_id=sandbox_id, timeout_s=row.timeout_s, on_timeout=row.on_timeout,
                keep_snapshots=row.keep_snapshots, snapshot_interval_s=row.snapshot_interval_s,
                snapshot_after_command=row.snapshot_after_command, snapshot_keep=row.snapshot_keep,
                snapshot_max_age_s=row.snapshot_max_age_s, env=row.env, expose=row.expose))
        await db.flush()
        for child_id, _ in children:
            db.add_all(SessionMetadataRow(session_id=child_id, key=k, value=v) for k, v in metadata.items())
            if parent_egress is not None:
                egress.store_policy(db, child_id, dict(parent_egress.policy),
                                    dict(parent_egress.placeholders))
        await check_quota(db, plane.settings, tenant)
        await db.commit()
    client = plane.node_client(node)
    branch_egress = None if parent_egress is None else [
        dataclasses.replace(parent_egress, session_id=child_id) for child_id, _ in children]
    try:
        await client.branch_snapshot(snap_id, [sbx for _, sbx in children], row.env or {},
                                     egress=branch_egress)
    except BaseException as exc:
        reason = f"{exc.code}: {exc.message}" if isinstance(exc, NodeError) else type(exc).__name__
        for child_id, _ in children:
            await fail_session(plane, child_id, f"branch could not be started ({reason})")
        if isinstance(exc, NodeError):
            raise node_error(exc, f"session {session_id} could not be branched") from exc
        raise
    async with plane.db() as db:
        for child_id, sandbox_id in children:
            if not await transition(db, child_id, "running", sources=("creating",)):
                await destroy_quietly(client, sandbox_id)
        await db.commit()
        rows = [await db.get(SessionRow, cid, populate_existing=True) for cid, _ in children]
        items = [to_out(r, metadata) for r in rows if r is not None]
    return BranchOut(snapshot_id=snap_id, items=items)


async def reap_to_pause(plane: ControlPlane, session_id: str, reason: str) -> bool:
    """The reaper's pause for ``on_timeout: pause``; a sandbox that is already gone goes through
    :func:`lose_sandbox`. A pause the tenant's quota refuses closes the session instead (its time is up
    and it cannot be kept). Returns whether the session ended up paused."""
    try:
        await pause_session(plane, None, session_id, reason=reason)
    except QuotaExceeded as exc:
        log.warning("session %s closed at %s instead of paused: %s", session_id, reason, exc.message)
        await finish_session(plane, session_id, "closed", f"{reason}; not paused: {exc.message}")
        return False
    except ApiError as exc:
        log.warning("could not pause session %s at %s: %s", session_id, reason, exc.message)
        async with plane.db() as db:
            row = await db.get(SessionRow, session_id, populate_existing=True)
            return row is not None and row.state == "paused"
    return True


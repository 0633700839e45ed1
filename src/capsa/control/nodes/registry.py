"""Node registry: enrolment, (re-)registration, heartbeats (with sandbox reconciliation), leaving and loss.

A node's credential (what it presents to the control plane) is stored as a SHA-256; its API token (what the
control plane presents to it) is stored encrypted (:mod:`capsa.control.nodes.secrets`).
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import or_, select, update

from capsa.common.ids import new_id
from capsa.control.egress import service as egress
from capsa.control.errors import EnrolTokenInvalid, NotFound, Unauthorized
from capsa.control.nodes.secrets import hash_secret, new_credential, new_enrol_token, secret_matches
from capsa.control.nodes.urls import check_node_url
from capsa.control.plane import ControlPlane
from capsa.control.schemas import (
    Capacity,
    HeartbeatOut,
    NodeEnrol,
    NodeEnrolled,
    NodeHeartbeat,
    NodeOut,
    NodeRegister,
    NodeToken,
    NodeTokenCreate,
    NodeUpdate,
)
from capsa.control.sessions.recovery import recover_session
from capsa.control.sessions.service import finish_session, lose_sandbox
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeEnrolTokenRow, NodeRow, SessionRow, utcnow

__all__ = [
    "check_enrol_token",
    "check_node_credential",
    "create_enrol_token",
    "enrol_node",
    "fail_silent_nodes",
    "heartbeat",
    "leave_node",
    "list_nodes",
    "node_out",
    "register_node",
    "update_node",
]

_CAPACITY_KEYS = ("memory_mib", "vcpus", "max_sandboxes")


def node_out(row: NodeRow, heartbeat_timeout: float) -> NodeOut:
    healthy = (row.left_at is None and row.token_sealed is not None
               and row.last_heartbeat_at >= utcnow() - timedelta(seconds=heartbeat_timeout))
    return NodeOut(
        id=row.id, name=row.name, url=row.url,
        capacity={"memory_mib": row.memory_mib, "vcpus": row.vcpus, "max_sandboxes": row.max_sandboxes},
        capacity_limit=dict(row.capacity_limit) if row.capacity_limit else None,
        used=dict(row.used or {}), templates=list(row.templates or []), egress=bool(row.egress),
        store=row.store, draining=bool(row.draining), registered_at=row.registered_at,
        last_heartbeat_at=row.last_heartbeat_at, left_at=row.left_at, healthy=healthy,
    )


NODE_LEFT = "node stopped"
NODE_SILENT = "node stopped sending heartbeats"


async def _sessions_on(db: DbSession, node_id: str) -> list[tuple[str, bool]]:
    """(id, already expired) of the sessions that hold a sandbox on the node."""
    now = utcnow()
    rows = await db.execute(select(SessionRow.id, SessionRow.expires_at).where(
        SessionRow.node_id == node_id, SessionRow.state.in_(ACTIVE_STATES)))
    return [(sid, expires_at <= now) for sid, expires_at in rows.all()]


async def _drop_sandboxes(plane: ControlPlane, sessions: list[tuple[str, bool]], reason: str, *,
                          lost: bool = False) -> None:
    """The node's sandboxes are gone: each session is paused at its latest snapshot or failed (``lost``: the
    node itself is gone, and the session is recovered elsewhere first if it can be, exactly as the reaper
    would)."""
    for session_id, expired in sessions:
        if expired:  # it would have been closed anyway: record what the reaper would have
            await finish_session(plane, session_id, "closed", "timeout")
        elif lost:
            await recover_session(plane, session_id, reason)
        else:
            await lose_sandbox(plane, session_id, reason)


def _set_capacity(row: NodeRow, reported: Capacity | None = None, limit: Capacity | None = None) -> None:
    """Record what the node reports and/or a new limit; the capacity placement uses is the smaller.

    A node's own report (heartbeat, re-registration) never raises its capacity above the limit it
    enrolled with: a leaked node credential cannot make one node attract every new session. Only an
    admin (``PATCH /v1/nodes/{id}``, or registering the node by hand) sets the limit.
    """
    current = {"memory_mib": row.memory_mib, "vcpus": row.vcpus, "max_sandboxes": row.max_sandboxes}
    if reported is not None:
        row.capacity_reported = reported.model_dump()
    if limit is not None:
        row.capacity_limit = limit.model_dump()
    have = dict(row.capacity_reported or row.capacity_limit or current)
    bound = dict(row.capacity_limit or have)
    row.memory_mib, row.vcpus, row.max_sandboxes = (min(int(have[k]), int(bound[k])) for k in _CAPACITY_KEYS)


async def _load_out(plane: ControlPlane, node_id: str) -> NodeOut:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            raise NotFound(f"node {node_id} not found")
        return node_out(row, plane.settings.node_heartbeat_timeout)


async def create_enrol_token(plane: ControlPlane, req: NodeTokenCreate) -> NodeToken:
    """A one-time enrolment token; only its hash is stored."""
    token, now = new_enrol_token(), utcnow()
    expires_at = now + timedelta(seconds=req.ttl_seconds)
    async with plane.db() as db:
        db.add(NodeEnrolTokenRow(token_hash=hash_secret(token), created_at=now, expires_at=expires_at))
        await db.commit()
    return NodeToken(token=token, expires_at=expires_at)


async def check_enrol_token(plane: ControlPlane, enrol_token: str | None) -> None:
    """Raise ``EnrolTokenInvalid`` unless ``enrol_token`` is known, unused and unexpired. Only a read:
    :func:`enrol_node` is what consumes a token (the request guard asks this before reading the body)."""
    if not enrol_token:
        raise EnrolTokenInvalid()
    async with plane.db() as db:
        found = (await db.execute(select(NodeEnrolTokenRow.token_hash).where(
            NodeEnrolTokenRow.token_hash == hash_secret(enrol_token), NodeEnrolTokenRow.used_at.is_(None),
            NodeEnrolTokenRow.expires_at > utcnow()))).first()
    if found is None:
        raise EnrolTokenInvalid()


async def enrol_node(plane: ControlPlane, enrol_token: str | None, req: NodeEnrol) -> NodeEnrolled:
    """Create a node from a one-time token. The token is consumed by a conditional UPDATE in the same
    transaction that creates the node, so of two replicas racing for one token exactly one succeeds."""
    if not enrol_token:
        raise EnrolTokenInvalid()
    check_node_url(req.url, allow_insecure=plane.settings.allow_insecure_node_urls)
    sealer = plane.node_sealer()
    node_id, credential, now = new_id("node"), new_credential(), utcnow()
    async with plane.db() as db:
        claimed = await db.execute(
            update(NodeEnrolTokenRow)
            .where(NodeEnrolTokenRow.token_hash == hash_secret(enrol_token),
                   NodeEnrolTokenRow.used_at.is_(None), NodeEnrolTokenRow.expires_at > now)
            .values(used_at=now, node_id=node_id))
        if claimed.rowcount != 1:  # type: ignore[attr-defined]  # CursorResult of an UPDATE
            await db.rollback()
            raise EnrolTokenInvalid()
        row = NodeRow(
            id=node_id, name=req.name, url=req.url, token_sealed=sealer.seal(node_id, req.api_token),
            credential_hash=hash_secret(credential), templates=list(req.templates),
            egress=req.egress, store=req.store, used={}, registered_at=now, last_heartbeat_at=now,
            left_at=None)
        _set_capacity(row, req.capacity, limit=req.capacity)  # the enrolled capacity is the limit
        db.add(row)
        await db.commit()
    return NodeEnrolled(id=node_id, credential=credential)


async def register_node(plane: ControlPlane, node_id: str, req: NodeRegister, *,
                        credential: str | None = None, name: str | None = None,
                        set_limit: bool = True) -> NodeOut:
    """Add or re-add a node: the in-process admin path, also behind ``/register`` for an enrolled node.

    A (re-)registering node has just started and removed every old VM, so sessions that were running there
    lose their sandbox now (paused at their latest snapshot, or failed) rather than pointing at nothing.
    ``credential``: set (hashed) as the node's credential; None keeps the one it has (an in-process node
    that never calls the HTTP API may have none). ``set_limit``: the registration comes from an admin (or
    the in-process node) and its capacity becomes the node's limit; False (a node re-registering with its
    own credential): the capacity stays bounded by the limit it has.
    """
    check_node_url(req.url, allow_insecure=plane.settings.allow_insecure_node_urls)
    sealer = plane.node_sealer()
    now = utcnow()
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            row = NodeRow(id=node_id, registered_at=now, used={}, name=name)
            db.add(row)
        elif name is not None:
            row.name = name
        row.url, row.token_sealed = req.url, sealer.seal(node_id, req.api_token)
        if credential is not None:
            row.credential_hash = hash_secret(credential)
        row.templates, row.egress, row.store = list(req.templates), req.egress, req.store
        fresh = row.capacity_limit is None
        _set_capacity(row, req.capacity, limit=req.capacity if set_limit or fresh else None)
        row.registered_at = row.last_heartbeat_at = now
        row.left_at = None
        stale = await _sessions_on(db, node_id)
        await db.commit()
    await _drop_sandboxes(plane, stale, "node restarted; its sandbox is gone")
    return await _load_out(plane, node_id)


async def check_node_credential(plane: ControlPlane, node_id: str, credential: str | None) -> None:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id)
    if row is None or not secret_matches(credential, row.credential_hash):
        raise Unauthorized("unknown node or wrong node credential")


async def heartbeat(plane: ControlPlane, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            raise NotFound(f"node {node_id} not found")
        row.last_heartbeat_at = utcnow()
        row.used = dict(req.used)
        if req.capacity is not None:
            _set_capacity(row, req.capacity)
        if req.templates is not None:
            row.templates = list(req.templates)
        failed: list[tuple[str, str | None]] = []
        if req.failed_sandboxes:
            rows = await db.execute(select(SessionRow.id, SessionRow.sandbox_id).where(
                SessionRow.node_id == node_id, SessionRow.sandbox_id.in_(req.failed_sandboxes),
                SessionRow.state == "running"))
            failed = [(sid, sbx) for sid, sbx in rows.all()]
        orphans: list[str] = []
        if req.sandboxes:
            owned = await db.execute(select(SessionRow.sandbox_id).where(
                SessionRow.node_id == node_id, SessionRow.sandbox_id.in_(req.sandboxes),
                SessionRow.state.in_(ACTIVE_STATES)))
            orphans = sorted(set(req.sandboxes) - set(owned.scalars()))
        await db.commit()
        if orphans:
            plane.metrics.orphans.inc(len(orphans))
        out = HeartbeatOut(**node_out(row, plane.settings.node_heartbeat_timeout).model_dump(),
                           destroy_sandboxes=orphans)
    for session_id, sandbox_id in failed:
        await lose_sandbox(plane, session_id, "the sandbox's VM died", sandbox_id)
    # Keep the audit copy fresh: events wait in the node's memory only until the next heartbeat.
    await egress.collect_audit_quietly(plane, row)
    return out


async def update_node(plane: ControlPlane, node_id: str, req: NodeUpdate) -> NodeOut:
    """An admin changes what a node may take: ``capacity_limit`` bounds what the node reports."""
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            raise NotFound(f"node {node_id} not found")
        if req.capacity_limit is not None:
            _set_capacity(row, limit=req.capacity_limit)
        await db.commit()
    return await _load_out(plane, node_id)


async def leave_node(plane: ControlPlane, node_id: str) -> NodeOut:
    """The node is stopping (without a drain): it gets no new sessions from now on, and its running sessions
    are handled as those of a lost node now (recovered elsewhere from a stored snapshot, paused at a local
    one, or failed as ``node_lost``). It takes sessions again once it registers."""
    async with plane.db() as db:
        done = await db.execute(update(NodeRow).where(NodeRow.id == node_id).values(left_at=utcnow()))
        if done.rowcount != 1:  # type: ignore[attr-defined]  # CursorResult of an UPDATE
            raise NotFound(f"node {node_id} not found")
        stale = await _sessions_on(db, node_id)
        await db.commit()
    await _drop_sandboxes(plane, stale, NODE_LEFT, lost=True)
    return await _load_out(plane, node_id)


async def list_nodes(plane: ControlPlane) -> list[NodeOut]:
    async with plane.db() as db:
        rows = await db.execute(select(NodeRow).order_by(NodeRow.id))
        return [node_out(r, plane.settings.node_heartbeat_timeout) for r in rows.scalars()]


async def fail_silent_nodes(plane: ControlPlane) -> list[str]:
    """Recover, pause or fail every running session on a node silent for ``node_dead_after_s`` or gone
    (:func:`~capsa.control.sessions.recovery.recover_session`); returns the failed ids.

    Safe with several replicas: each session's change is a conditional update, so exactly one replica acts
    on it.
    """
    cutoff = utcnow() - timedelta(seconds=plane.settings.node_dead_after_s)
    async with plane.db() as db:
        rows = await db.execute(
            select(SessionRow.id, NodeRow.left_at).join(NodeRow, NodeRow.id == SessionRow.node_id)
            .where(or_(NodeRow.last_heartbeat_at < cutoff, NodeRow.left_at.is_not(None)),
                   SessionRow.state == "running")
        )
        found = [(sid, NODE_LEFT if left_at is not None else NODE_SILENT) for sid, left_at in rows.all()]
    # A session with a stored snapshot is recovered on another node; one with a snapshot on the lost node
    # only is paused (it resumes once a node can read that snapshot again); the others fail (node_lost).
    # A node's leave call handles its sessions the same way, so whichever of the two comes first, the
    # outcome and its reasons are the same.
    return [sid for sid, why in found if await recover_session(plane, sid, why) == "failed"]

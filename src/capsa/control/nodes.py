"""Node registry: registration, heartbeats (with sandbox reconciliation) and node loss."""

from __future__ import annotations

import hmac
from datetime import timedelta

from sqlalchemy import select

from capsa.control import egress
from capsa.control.errors import NotFound, Unauthorized
from capsa.control.lifecycle import ACTIVE_STATES
from capsa.control.plane import ControlPlane
from capsa.control.schemas import HeartbeatOut, NodeHeartbeat, NodeOut, NodeRegister
from capsa.control.sessions import finish_session, lose_sandbox
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow, SessionRow, utcnow

__all__ = ["check_node_token", "fail_silent_nodes", "heartbeat", "list_nodes", "node_out", "register_node"]


def node_out(row: NodeRow, heartbeat_timeout: float) -> NodeOut:
    healthy = row.last_heartbeat_at >= utcnow() - timedelta(seconds=heartbeat_timeout)
    return NodeOut(
        id=row.id, url=row.url,
        capacity={"memory_mib": row.memory_mib, "vcpus": row.vcpus, "max_sandboxes": row.max_sandboxes},
        used=dict(row.used or {}), templates=list(row.templates or []), registered_at=row.registered_at,
        last_heartbeat_at=row.last_heartbeat_at, healthy=healthy,
    )


async def _sessions_on(db: DbSession, node_id: str) -> list[tuple[str, bool]]:
    """(id, already expired) of the sessions that hold a sandbox on the node."""
    now = utcnow()
    rows = await db.execute(select(SessionRow.id, SessionRow.expires_at).where(
        SessionRow.node_id == node_id, SessionRow.state.in_(ACTIVE_STATES)))
    return [(sid, expires_at <= now) for sid, expires_at in rows.all()]


async def register_node(plane: ControlPlane, req: NodeRegister) -> NodeOut:
    """Add or re-add a node. A (re-)registering node has just started and removed every old VM, so
    sessions that were running there are failed now rather than left pointing at nothing."""
    now = utcnow()
    async with plane.db() as db:
        row = await db.get(NodeRow, req.id)
        if row is None:
            row = NodeRow(id=req.id, registered_at=now, used={})
            db.add(row)
        row.url, row.token, row.templates = req.url, req.token, list(req.templates)
        row.memory_mib, row.vcpus = req.capacity.memory_mib, req.capacity.vcpus
        row.max_sandboxes = req.capacity.max_sandboxes
        row.registered_at = row.last_heartbeat_at = now
        stale = await _sessions_on(db, req.id)
        await db.commit()
    for session_id, expired in stale:
        if expired:  # it would have been closed anyway: record what the reaper would have
            await finish_session(plane, session_id, "closed", "timeout")
        else:
            await lose_sandbox(plane, session_id, "node restarted; its sandbox is gone")
    async with plane.db() as db:
        fresh = await db.get(NodeRow, req.id, populate_existing=True)
        assert fresh is not None
        return node_out(fresh, plane.settings.node_heartbeat_timeout)


async def check_node_token(plane: ControlPlane, node_id: str, token: str | None) -> None:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id)
    if row is None or token is None or not hmac.compare_digest(row.token.encode(), token.encode()):
        raise Unauthorized("unknown node or wrong node token")


async def heartbeat(plane: ControlPlane, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            raise NotFound(f"node {node_id} not found")
        row.last_heartbeat_at = utcnow()
        row.used = dict(req.used)
        if req.capacity is not None:
            row.memory_mib, row.vcpus = req.capacity.memory_mib, req.capacity.vcpus
            row.max_sandboxes = req.capacity.max_sandboxes
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
        out = HeartbeatOut(**node_out(row, plane.settings.node_heartbeat_timeout).model_dump(),
                           destroy_sandboxes=orphans)
    for session_id, sandbox_id in failed:
        await lose_sandbox(plane, session_id, "the sandbox's VM died", sandbox_id)
    # Keep the audit copy fresh: events wait in the node's memory only until the next heartbeat.
    await egress.collect_audit_quietly(plane, row)
    return out


async def list_nodes(plane: ControlPlane) -> list[NodeOut]:
    async with plane.db() as db:
        rows = await db.execute(select(NodeRow).order_by(NodeRow.id))
        return [node_out(r, plane.settings.node_heartbeat_timeout) for r in rows.scalars()]


async def fail_silent_nodes(plane: ControlPlane) -> list[str]:
    """Fail every active session on a node that stopped heartbeating; returns the failed session ids."""
    cutoff = utcnow() - timedelta(seconds=plane.settings.node_heartbeat_timeout)
    async with plane.db() as db:
        rows = await db.execute(
            select(SessionRow.id).join(NodeRow, NodeRow.id == SessionRow.node_id)
            .where(NodeRow.last_heartbeat_at < cutoff, SessionRow.state == "running")
        )
        ids = list(rows.scalars())
    # A session with a snapshot is paused instead: it resumes once a node can read that snapshot again.
    reason = "node stopped sending heartbeats"
    return [sid for sid in ids if await lose_sandbox(plane, sid, reason) == "failed"]

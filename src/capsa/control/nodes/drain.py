"""Draining a node for maintenance (``capsa nodes drain``): it gets no new sandboxes, and each of its running
sessions moves to another node with its memory, processes and files (a pause snapshot through the fleet's
store, resumed elsewhere). A session that cannot move (its snapshot did not reach the store, no other node
has room) stays paused, resumable, and is reported. ``undrain`` lets the node take sandboxes again."""

from __future__ import annotations

import logging

from sqlalchemy import select

from capsa.control.errors import ApiError, NotFound
from capsa.control.nodes.registry import node_out
from capsa.control.plane import ControlPlane
from capsa.control.schemas import DrainOut, DrainStayed, NodeOut
from capsa.control.sessions.snapshots import pause_session, resume_session
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.store.models import NodeRow, SessionRow

__all__ = ["drain_node", "undrain_node"]

log = logging.getLogger(__name__)


async def _set_draining(plane: ControlPlane, node_id: str, draining: bool) -> None:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        if row is None:
            raise NotFound(f"node {node_id} not found")
        row.draining = draining
        await db.commit()


async def _move(plane: ControlPlane, tenant: str, session_id: str) -> str | None:
    """Move one running session off its node; None when it runs elsewhere now, else why it did not."""
    try:
        await pause_session(plane, None, session_id, reason="node drained")
    except ApiError as e:
        return f"could not be paused: {e}"
    try:
        moved = await resume_session(plane, tenant, session_id)
    except ApiError as e:
        return f"paused, not resumed elsewhere: {e}"
    return None if moved.state == "running" else f"is {moved.state}"


async def drain_node(plane: ControlPlane, node_id: str) -> DrainOut:
    await _set_draining(plane, node_id, True)
    async with plane.db() as db:
        rows = await db.execute(select(SessionRow.id, SessionRow.tenant)
                                .where(SessionRow.node_id == node_id, SessionRow.state == "running")
                                .order_by(SessionRow.created_at))
        running = list(rows.all())
    moved: list[str] = []
    stayed: list[DrainStayed] = []
    for session_id, tenant in running:
        why = await _move(plane, tenant, session_id)
        if why is None:
            moved.append(session_id)
        else:
            log.warning("drain of node %s: session %s %s", node_id, session_id, why)
            stayed.append(DrainStayed(session_id=session_id, reason=why))
    async with plane.db() as db:
        left = (await db.execute(select(SessionRow.id).where(SessionRow.node_id == node_id,
                                                             SessionRow.state.in_(ACTIVE_STATES)))).all()
        row = await db.get(NodeRow, node_id, populate_existing=True)
        assert row is not None
        out = node_out(row, plane.settings.node_heartbeat_timeout)
    return DrainOut(node=out, moved=moved, stayed=stayed, drained=not left)


async def undrain_node(plane: ControlPlane, node_id: str) -> NodeOut:
    await _set_draining(plane, node_id, False)
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id, populate_existing=True)
        assert row is not None
        return node_out(row, plane.settings.node_heartbeat_timeout)

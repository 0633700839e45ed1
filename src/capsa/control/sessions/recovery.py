"""Failover: a running session whose node died comes back on another node from its latest stored snapshot.

When a node stops heartbeating for ``node_dead_after_s`` (``CAPSA_NODE_DEAD_AFTER_S``) or leaves (stops
without a drain), each of its running sessions is handled once, the same way whether the node's leave call
or the reaper comes first (every step is a conditional state change, so with several replicas
exactly one acts on a session):

- its latest snapshot is in the fleet's store and another healthy node reads that store: the session goes
  ``running -> recovering`` onto that node under a new sandbox id, is restored there from the snapshot (its
  egress policy, secrets and placeholders as recorded) and goes ``recovering -> running``; the audit trail
  records ``session recover`` with the snapshot, its time and what was lost since (seconds of work);
- else, with a snapshot left on the dead node only (no store, or its push failed), it is paused at it (it
  resumes once a node can read it, as before the store);
- else it fails with reason ``node_lost``.

Each outcome is counted in ``capsa_session_recoveries_total`` (``recovered``, ``paused``, ``failed``, by
the replica that acted; :func:`~capsa.control.sessions.service.lose_sandbox` counts the last two), and the
restore onto the new node is timed as the ``recover`` operation.

Fencing: the recovered session has a new sandbox id on another node, so nothing of the control plane
routes to the old sandbox again, and when the dead node comes back its old sandbox is owned by no live
session: its re-registration fails nothing of the recovered session, and its heartbeat answer lists the
sandbox in ``destroy_sandboxes``.
"""

from __future__ import annotations

import logging
import time

from capsa.common.ids import new_id
from capsa.control.audit import trail as audit_trail
from capsa.control.errors import ApiError
from capsa.control.nodes.placement import choose_snapshot_node
from capsa.control.plane import ControlPlane
from capsa.control.sessions.service import destroy_quietly, lose_sandbox
from capsa.control.sessions.snapshots import back_running, latest_snapshot, restore_onto
from capsa.control.sessions.states import transition
from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["NODE_LOST", "recover_session"]

log = logging.getLogger(__name__)

NODE_LOST = "node_lost"


async def recover_session(plane: ControlPlane, session_id: str, why: str) -> str:
    """Handle a running session whose node is lost (``why``: how that was noticed, for the trail and the
    log); returns its resulting state (see the module doc)."""
    sandbox_id = new_id("sbx")
    async with plane.db() as db:
        row = await db.get(SessionRow, session_id, populate_existing=True)
        if row is None or row.state != "running":
            return row.state if row is not None else "failed"
        snap = await latest_snapshot(db, session_id, stored=True)
        node = None
        if snap is not None:
            try:
                node = await choose_snapshot_node(db, snap, row.memory_mib, row.vcpus,
                                                  plane.settings.node_heartbeat_timeout)
            except ApiError as e:
                log.warning("session %s cannot be recovered now: %s", session_id, e)
        if snap is None or node is None or node.id == row.node_id:
            await db.rollback()
            return await lose_sandbox(plane, session_id, NODE_LOST, why=why)
        lost_node, lost_sandbox = row.node_id, row.sandbox_id
        if not await transition(db, session_id, "recovering", sources=("running",), node_id=node.id,
                                sandbox_id=sandbox_id):
            await db.rollback()
            current = await db.get(SessionRow, session_id, populate_existing=True)
            return current.state if current is not None else "failed"
        plane.sessions.forget(session_id)
        await db.commit()

    async def back_to_lost(db: DbSession) -> None:
        # The restore failed: the session is paused at the snapshot (a resume may find room later).
        await transition(db, session_id, "paused", sources=("recovering",), sandbox_id=None,
                         node_id=snap.node_id,
                         pause_reason=f"sandbox lost ({why}); recovery failed; resume continues from "
                                      f"snapshot {snap.id}")

    client = plane.node_client(node)
    started = time.perf_counter()
    try:
        await restore_onto(plane, client, row, snap, sandbox_id, undo=back_to_lost, what="recovered")
    except Exception as e:
        plane.metrics.operation_seconds.labels("recover", "error").observe(time.perf_counter() - started)
        log.warning("session %s: recovery on node %s failed: %s", session_id, node.id, e)
        async with plane.db() as db:
            current = await db.get(SessionRow, session_id, populate_existing=True)
        if current is not None and current.state == "paused":
            plane.metrics.sandbox_losses.labels("paused").inc()
        return current.state if current is not None else "failed"
    plane.metrics.operation_seconds.labels("recover", "ok").observe(time.perf_counter() - started)
    lost = round((utcnow() - snap.created_at).total_seconds(), 1)
    async with plane.db() as db:
        running = await back_running(db, session_id, "recovering")
        if running:
            await audit_trail.record(db, tenant=row.tenant, kind="session", action="recover",
                                     session_id=session_id,
                                     detail={"reason": why, "snapshot_id": snap.id,
                                             "snapshot_at": snap.created_at.isoformat(),
                                             "lost_seconds": lost,
                                             "from_node": lost_node, "from_sandbox": lost_sandbox,
                                             "node": node.id, "sandbox_id": sandbox_id})
        await db.commit()
    if not running:  # closed while it was being recovered: the new sandbox must not outlive that
        await destroy_quietly(client, sandbox_id)
        return "closed"
    plane.metrics.sandbox_losses.labels("recovered").inc()
    log.warning("session %s recovered on node %s from snapshot %s (%s; %.1f s of work lost)", session_id,
                node.id, snap.id, why, lost)
    return "running"

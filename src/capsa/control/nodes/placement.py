"""Choosing a node for a new sandbox: healthy (recent heartbeat, not left), has the template, can run
networked sandboxes when the session has an egress policy, has room; most free memory wins."""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

from sqlalchemy import func, select

from capsa.control.errors import NoCapacity, TemplateNotFound
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.store.db import DbSession
from capsa.control.store.egress_models import SessionPolicyRow
from capsa.control.store.models import NodeRow, SessionRow, SnapshotRow, utcnow

__all__ = ["choose_node", "choose_snapshot_node", "healthy_nodes"]


async def healthy_nodes(db: DbSession, heartbeat_timeout: float) -> list[NodeRow]:
    cutoff = utcnow() - timedelta(seconds=heartbeat_timeout)
    rows = await db.execute(select(NodeRow).where(
        NodeRow.last_heartbeat_at >= cutoff, NodeRow.left_at.is_(None), NodeRow.token_sealed.is_not(None)))
    return list(rows.scalars())


async def _placeable(db: DbSession, heartbeat_timeout: float) -> list[NodeRow]:
    """Healthy nodes that take new sandboxes (a draining node does not)."""
    return [n for n in await healthy_nodes(db, heartbeat_timeout) if not n.draining]


async def choose_node(db: DbSession, template: str, memory_mib: int, vcpus: int,
                      heartbeat_timeout: float, egress: bool = False,
                      exclude: Collection[str] = ()) -> NodeRow:
    """``egress``: the session has an egress policy, so only nodes with an egress broker can run it;
    ``exclude``: nodes not to choose (they refused this sandbox already)."""
    nodes = [n for n in await _placeable(db, heartbeat_timeout) if n.id not in exclude]
    if not nodes:
        raise NoCapacity("no healthy node is registered")
    candidates = [node for node in nodes if template in (node.templates or [])]
    if not candidates:
        raise TemplateNotFound(f"template {template!r} is not available on any node")
    if egress:
        candidates = [node for node in candidates if node.egress]
        if not candidates:
            raise NoCapacity("no healthy node can run networked sessions (none has egress enabled); "
                             f"create the session without a policy or start a node with egress (template "
                             f"{template!r})")
    return await _roomiest(db, candidates, memory_mib, vcpus)


async def choose_snapshot_node(db: DbSession, snap: SnapshotRow, memory_mib: int, vcpus: int,
                               heartbeat_timeout: float, count: int = 1) -> NodeRow:
    """A node that can read a snapshot and has room for ``count`` sandboxes of its size.

    The node that took it holds it in its storage pool and is preferred (no transfer) while it is healthy
    and has room. A snapshot in the fleet's store (``stored``) can also go to any healthy node reporting the
    same store (one that can run networked sandboxes when the session has an egress policy), which pulls
    it first; most free memory wins among those.
    """
    nodes = await _placeable(db, heartbeat_timeout)
    holder = [n for n in nodes if n.id == snap.node_id]
    if holder:
        try:
            return await _roomiest(db, holder, memory_mib * count, vcpus * count, count)
        except NoCapacity:
            if not snap.stored:
                raise
    store = (await db.get(NodeRow, snap.node_id)) if snap.stored else None
    if store is None or store.store is None:
        raise NoCapacity(f"node {snap.node_id}, which holds the snapshot, is not available")
    networked = await db.get(SessionPolicyRow, snap.session_id) is not None
    others = [n for n in nodes
              if n.id != snap.node_id and n.store == store.store and (n.egress or not networked)]
    if not others:
        raise NoCapacity(f"node {snap.node_id}, which took the snapshot, is not available and no other "
                         "healthy node reads the store it is in")
    return await _roomiest(db, others, memory_mib * count, vcpus * count, count)


async def _roomiest(db: DbSession, candidates: list[NodeRow], memory_mib: int, vcpus: int,
                    count: int = 1) -> NodeRow:
    usage = await db.execute(
        select(SessionRow.node_id, func.count(), func.coalesce(func.sum(SessionRow.memory_mib), 0),
               func.coalesce(func.sum(SessionRow.vcpus), 0))
        .where(SessionRow.state.in_(ACTIVE_STATES), SessionRow.node_id.in_([n.id for n in candidates]))
        .group_by(SessionRow.node_id)
    )
    used = {node_id: (int(n), int(mem), int(cpu)) for node_id, n, mem, cpu in usage.all()}
    best: tuple[int, NodeRow] | None = None
    for node in candidates:
        used_count, mem, cpu = used.get(node.id, (0, 0, 0))
        free_mem = node.memory_mib - mem
        if used_count + count > node.max_sandboxes or free_mem < memory_mib or node.vcpus - cpu < vcpus:
            continue
        if best is None or free_mem > best[0]:
            best = (free_mem, node)
    if best is None:
        raise NoCapacity(f"no node has room for {memory_mib} MiB and {vcpus} vCPU(s)")
    return best[1]

"""Choosing a node for a new sandbox: healthy, has the template, most free memory wins."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from capsa.control.errors import NoCapacity, TemplateNotFound
from capsa.control.lifecycle import ACTIVE_STATES
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow, SessionRow, utcnow

__all__ = ["choose_node", "healthy_nodes"]


async def healthy_nodes(db: DbSession, heartbeat_timeout: float) -> list[NodeRow]:
    cutoff = utcnow() - timedelta(seconds=heartbeat_timeout)
    rows = await db.execute(select(NodeRow).where(NodeRow.last_heartbeat_at >= cutoff))
    return list(rows.scalars())


async def choose_node(db: DbSession, template: str, memory_mib: int, vcpus: int,
                      heartbeat_timeout: float) -> NodeRow:
    nodes = await healthy_nodes(db, heartbeat_timeout)
    if not nodes:
        raise NoCapacity("no healthy node is registered")
    candidates = [node for node in nodes if template in (node.templates or [])]
    if not candidates:
        raise TemplateNotFound(f"template {template!r} is not available on any node")
    usage = await db.execute(
        select(SessionRow.node_id, func.count(), func.coalesce(func.sum(SessionRow.memory_mib), 0),
               func.coalesce(func.sum(SessionRow.vcpus), 0))
        .where(SessionRow.state.in_(ACTIVE_STATES), SessionRow.node_id.in_([n.id for n in candidates]))
        .group_by(SessionRow.node_id)
    )
    used = {node_id: (int(count), int(mem), int(cpu)) for node_id, count, mem, cpu in usage.all()}
    best: tuple[int, NodeRow] | None = None
    for node in candidates:
        count, mem, cpu = used.get(node.id, (0, 0, 0))
        free_mem = node.memory_mib - mem
        if count >= node.max_sandboxes or free_mem < memory_mib or node.vcpus - cpu < vcpus:
            continue
        if best is None or free_mem > best[0]:
            best = (free_mem, node)
    if best is None:
        raise NoCapacity(f"no node has room for {memory_mib} MiB and {vcpus} vCPU(s)")
    return best[1]

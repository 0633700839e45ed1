"""Tenant limits and a bounded audit trail (security findings 8 and 10).

- ``nodes.capacity_limit``: what the node enrolled with (or an admin set); heartbeats and re-registrations
  cannot raise the capacity above it. Existing nodes get their current capacity as the limit.
  ``nodes.capacity_reported``: what the node last said it has (the effective capacity is the smaller one).
- ``audit_cursors``: how far the control plane has copied each node's audit log, kept apart from the events
  so that purging old events never makes a node's buffer look new again.
- ``audit_dropped``: per session, events a node dropped before they were collected (cumulative per node
  process, so replicas writing the same figure twice agree).
- indexes for the retention purge (by tenant and by time).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_nodes = sa.table(
    "nodes",
    sa.column("id", sa.String()),
    sa.column("memory_mib", sa.Integer()),
    sa.column("vcpus", sa.Integer()),
    sa.column("max_sandboxes", sa.Integer()),
    sa.column("capacity_limit", sa.JSON()),
    sa.column("capacity_reported", sa.JSON()),
)


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("capacity_limit", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("capacity_reported", sa.JSON(), nullable=True))
    connection = op.get_bind()
    for node_id, memory, vcpus, count in connection.execute(sa.select(
            _nodes.c.id, _nodes.c.memory_mib, _nodes.c.vcpus, _nodes.c.max_sandboxes)).all():
        capacity = {"memory_mib": memory, "vcpus": vcpus, "max_sandboxes": count}
        connection.execute(_nodes.update().where(_nodes.c.id == node_id).values(
            capacity_limit=capacity, capacity_reported=capacity))
    op.create_table(
        "audit_cursors",
        sa.Column("node_id", sa.String(64), primary_key=True),
        sa.Column("node_epoch", sa.String(64), nullable=False),
        sa.Column("node_seq", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "audit_dropped",
        sa.Column("session_id", sa.String(32), primary_key=True),
        sa.Column("node_id", sa.String(64), primary_key=True),
        sa.Column("node_epoch", sa.String(64), primary_key=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_audit_events_tenant", "audit_events", ["tenant", "id"])
    op.create_index("ix_audit_events_time", "audit_events", ["time"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_time", "audit_events")
    op.drop_index("ix_audit_events_tenant", "audit_events")
    op.drop_table("audit_dropped")
    op.drop_table("audit_cursors")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("capacity_reported")
        batch.drop_column("capacity_limit")

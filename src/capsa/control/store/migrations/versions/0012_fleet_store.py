"""The fleet: ``nodes.store`` (the store a node reads and writes, as it reported it), ``nodes.draining``
(an admin is moving its sessions off: it gets no new ones), ``snapshots.stored`` (the snapshot is in
that store, so any node of the same store can restore it) and ``sessions.snapshot_max_age_s`` (rolling
snapshots older than this are deleted).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as nodes:
        nodes.add_column(sa.Column("store", sa.String(1024), nullable=True))
        nodes.add_column(sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("snapshots") as snapshots:
        snapshots.add_column(sa.Column("stored", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("sessions") as sessions:
        sessions.add_column(sa.Column("snapshot_max_age_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as sessions:
        sessions.drop_column("snapshot_max_age_s")
    with op.batch_alter_table("snapshots") as snapshots:
        snapshots.drop_column("stored")
    with op.batch_alter_table("nodes") as nodes:
        nodes.drop_column("draining")
        nodes.drop_column("store")

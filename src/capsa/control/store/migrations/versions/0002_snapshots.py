"""Sessions that outlive sandboxes: snapshot records, pause/timeout options, rolling snapshot policy.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("timeout_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("on_timeout", sa.String(8), nullable=False, server_default="close"))
        batch.add_column(sa.Column("keep_snapshots", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("snapshot_interval_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("snapshot_after_command", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("snapshot_keep", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("snapshot_wanted_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("last_snapshot_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("snapshot_claim_until", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("pause_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("env", sa.JSON(), nullable=True))
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("parent", sa.String(32), nullable=True),
    )
    op.create_index("ix_snapshots_session_created", "snapshots", ["session_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_snapshots_session_created", "snapshots")
    op.drop_table("snapshots")
    with op.batch_alter_table("sessions") as batch:
        for name in ("env", "pause_reason", "snapshot_claim_until", "last_snapshot_at", "snapshot_wanted_at",
                     "snapshot_keep", "snapshot_after_command", "snapshot_interval_s", "keep_snapshots",
                     "on_timeout", "timeout_s"):
            batch.drop_column(name)

"""Egress grants: ``egress_grants`` (tenant, network) — the internal networks an admin lets a tenant's
sandboxes reach (of those the nodes' ``CAPSA_EGRESS_ALLOW_NETWORKS`` open).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "egress_grants",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("network", sa.String(64), primary_key=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("created_by", sa.String(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("egress_grants")

"""The tenant audit chain: ``audit_trail`` (hash-chained events per tenant) and ``audit_heads`` (each
tenant's newest seq and hash, locked by every append).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_trail",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("time_us", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("request_id", sa.String(40), nullable=True),
        sa.Column("session_id", sa.String(32), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )
    op.create_index("ix_audit_trail_session", "audit_trail", ["tenant", "session_id", "seq"])
    op.create_index("ix_audit_trail_kind", "audit_trail", ["tenant", "kind", "seq"])
    op.create_index("ix_audit_trail_time", "audit_trail", ["tenant", "time_us"])
    op.create_index("ix_audit_trail_request", "audit_trail", ["tenant", "request_id"])
    op.create_table(
        "audit_heads",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("audit_heads")
    for name in ("ix_audit_trail_request", "ix_audit_trail_time", "ix_audit_trail_kind",
                 "ix_audit_trail_session"):
        op.drop_index(name, "audit_trail")
    op.drop_table("audit_trail")

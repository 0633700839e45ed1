"""Ports: the ``expose`` list of a session and the port proxy's access tokens.

- ``sessions.expose``: the ports the proxy may reach (JSON list; NULL: any port).
- ``port_tokens``: per-session, per-port tokens (SHA-256 stored), deleted when revoked or when the session
  ends.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("expose", sa.JSON(), nullable=True))
    op.create_table(
        "port_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_port_tokens_session", "port_tokens", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_port_tokens_session", "port_tokens")
    op.drop_table("port_tokens")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("expose")

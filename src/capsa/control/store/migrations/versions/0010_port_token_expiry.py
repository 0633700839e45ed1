"""Port tokens expire: ``port_tokens.expires_at``.

Tokens made before this revision had no lifetime; they are deleted (a client makes a new one, or asks
``GET …/browser`` again), so no token lives forever.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.text("DELETE FROM port_tokens"))
    with op.batch_alter_table("port_tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("port_tokens") as batch:
        batch.drop_column("expires_at")

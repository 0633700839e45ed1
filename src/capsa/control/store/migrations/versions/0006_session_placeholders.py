"""Session placeholders: the control plane's record of the placeholders a session's guest holds.

``session_policies.placeholders`` (JSON, secret id -> placeholder) is sent with every sandbox start of the
session (create, resume, restore, branch), so a guest restored from a snapshot keeps using the placeholders
it already holds. Existing rows get none (their sessions' running sandboxes keep the node's own).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("session_policies") as batch:
        batch.add_column(sa.Column("placeholders", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("session_policies") as batch:
        batch.drop_column("placeholders")

"""Nodes as separate processes: enrolment tokens, hashed node credentials, encrypted node API tokens,
egress capability, leaving.

The clear ``nodes.token`` column goes. Each existing row's token is sealed with the control plane's secret
key when ``migrate()`` is given one (``config.attributes["node_token_sealer"]``); without a key the row keeps
no token and the node must register again before it is called. The old token was also the node's heartbeat
credential, so its hash becomes the node's credential, and
existing nodes keep being treated as egress-capable.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import sqlalchemy as sa
from alembic import context, op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_nodes = sa.table(
    "nodes",
    sa.column("id", sa.String()),
    sa.column("token", sa.String()),
    sa.column("token_sealed", sa.LargeBinary()),
    sa.column("credential_hash", sa.String()),
    sa.column("egress", sa.Boolean()),
)


def upgrade() -> None:
    op.create_table(
        "node_enrol_tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("used_at", sa.DateTime(), nullable=True),
        sa.Column("node_id", sa.String(64), nullable=True),
    )
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("token_sealed", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("credential_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("name", sa.String(128), nullable=True))
        batch.add_column(sa.Column("egress", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("left_at", sa.DateTime(), nullable=True))
    seal: Callable[[str, str], bytes] | None = context.config.attributes.get("node_token_sealer")
    connection = op.get_bind()
    for node_id, token in connection.execute(sa.select(_nodes.c.id, _nodes.c.token)).all():
        connection.execute(_nodes.update().where(_nodes.c.id == node_id).values(
            token_sealed=seal(node_id, token) if seal is not None else None,
            credential_hash=hashlib.sha256(token.encode()).hexdigest(),
            egress=True))  # before this revision every node was assumed to have an egress broker
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("token")


def downgrade() -> None:
    # The clear token cannot be recovered without the key: nodes must register again after a downgrade.
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("token", sa.String(256), nullable=False, server_default=""))
        batch.drop_column("left_at")
        batch.drop_column("egress")
        batch.drop_column("name")
        batch.drop_column("credential_hash")
        batch.drop_column("token_sealed")
    op.drop_table("node_enrol_tokens")

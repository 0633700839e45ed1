"""Connections: OAuth 2.0 providers, connections (sign-ins, refresh and access tokens sealed) and sign-ins
under way.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "connection_providers",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("issuer", sa.Text(), nullable=True),
        sa.Column("authorization_endpoint", sa.Text(), nullable=True),
        sa.Column("token_endpoint", sa.Text(), nullable=False),
        sa.Column("revocation_endpoint", sa.Text(), nullable=True),
        sa.Column("device_authorization_endpoint", sa.Text(), nullable=True),
        sa.Column("client_id", sa.String(256), nullable=False),
        sa.Column("client_secret", sa.LargeBinary(), nullable=True),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("tenant", "name", name="uq_connection_providers_tenant_name"),
    )
    op.create_table(
        "connections",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("provider_id", sa.String(32), sa.ForeignKey("connection_providers.id"), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("refresh_token", sa.LargeBinary(), nullable=True),
        sa.Column("access_token", sa.LargeBinary(), nullable=True),
        sa.Column("access_expires_at", sa.Float(), nullable=True),
        sa.Column("access_lifetime", sa.Float(), nullable=True),
        sa.Column("refresh_lease_until", sa.Float(), nullable=True),
        sa.Column("refreshes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("connected_at", sa.DateTime(), nullable=True),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("tenant", "name", name="uq_connections_tenant_name"),
    )
    op.create_table(
        "connection_logins",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("connection_id", sa.String(32), sa.ForeignKey("connections.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column("redirect_uri", sa.Text(), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("interval", sa.Float(), nullable=False),
        sa.Column("used_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_connection_logins_connection", "connection_logins", ["connection_id"])


def downgrade() -> None:
    op.drop_index("ix_connection_logins_connection", "connection_logins")
    op.drop_table("connection_logins")
    op.drop_table("connections")
    op.drop_table("connection_providers")

"""Tables of connections: OAuth 2.0 providers a tenant registered, connections (a person's sign-in with a
provider) and sign-ins under way (migration 0010).

Every credential is sealed (:class:`capsa.control.secretbox.SecretSealer`, tenant and ``<row id>/<field>``
bound as associated data): the provider's client secret, a connection's refresh and access tokens, a
sign-in's PKCE verifier or device code. None of them is ever returned by the API.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from capsa.control.store.models import Base, UTCDateTime
from capsa.control.store.named import TenantNamed

__all__ = ["ConnectionLoginRow", "ConnectionProviderRow", "ConnectionRow"]


class ConnectionProviderRow(TenantNamed, Base):
    __tablename__ = "connection_providers"

    issuer: Mapped[str | None] = mapped_column(Text, nullable=True)
    authorization_endpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    token_endpoint: Mapped[str] = mapped_column(Text)
    revocation_endpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    device_authorization_endpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    client_id: Mapped[str] = mapped_column(String(256))
    client_secret: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    """Sealed; none for a public client."""
    scopes: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ConnectionRow(TenantNamed, Base):
    __tablename__ = "connections"

    provider_id: Mapped[str] = mapped_column(String(32), ForeignKey("connection_providers.id"))
    scopes: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    """Overrides the provider's scopes when set."""
    state: Mapped[str] = mapped_column(String(16))
    """``pending`` (no sign-in yet), ``active``, ``revoked`` (final)."""
    refresh_token: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    access_token: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    access_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Unix time the access token expires."""
    access_lifetime: Mapped[float | None] = mapped_column(Float, nullable=True)
    refresh_lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    """A replica refreshing holds this lease (conditional UPDATE), so one refresh runs fleet-wide."""
    refreshes: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    connected_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ConnectionLoginRow(Base):
    """A sign-in under way: authorization code (``state`` hashed as the id) or device grant."""

    __tablename__ = "connection_logins"
    __table_args__ = (Index("ix_connection_logins_connection", "connection_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """Code flow: SHA-256 of the ``state`` parameter; device flow: ``lgn_…`` (what the client polls)."""
    kind: Mapped[str] = mapped_column(String(8))
    tenant: Mapped[str] = mapped_column(String(64))
    connection_id: Mapped[str] = mapped_column(String(32), ForeignKey("connections.id", ondelete="CASCADE"))
    secret: Mapped[bytes] = mapped_column(LargeBinary)
    """Sealed PKCE code verifier (code) or device code (device)."""
    redirect_uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    expires_at: Mapped[float] = mapped_column(Float)
    interval: Mapped[float] = mapped_column(Float, default=5.0)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

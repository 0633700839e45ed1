"""Database tables of the control plane (SQLAlchemy 2 declarative)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = ["ApiKeyRow", "Base", "NodeEnrolTokenRow", "NodeRow", "PortTokenRow", "RateCounterRow",
           "SessionMetadataRow", "SessionRow", "SnapshotRow", "UTCDateTime", "utcnow"]


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stored as naive UTC (SQLite has no time zones), always returned timezone-aware."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(1024))
    token_sealed: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    """The node's API token, encrypted (control.node_secrets); None until the node registers again."""
    credential_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """SHA-256 of the node's own credential (register, heartbeat, leave)."""
    memory_mib: Mapped[int] = mapped_column(Integer)
    vcpus: Mapped[int] = mapped_column(Integer)
    max_sandboxes: Mapped[int] = mapped_column(Integer)
    templates: Mapped[list[str]] = mapped_column(JSON, default=list)
    used: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Migration 0004.
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    egress: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    """The node can run sessions with an egress policy."""
    left_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    """Set when the node said it was stopping; cleared when it registers again."""
    # Migration 0005. ``memory_mib``/``vcpus``/``max_sandboxes`` above are the effective capacity: what the
    # node reported, bounded by the limit.
    capacity_limit: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    """What the node enrolled with or an admin set; a node's own reports never raise its capacity above."""
    capacity_reported: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    """What the node last said it has."""
    # Migration 0012.
    store: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    """The fleet store the node reads and writes (as it reported it); None: it keeps snapshots to itself."""
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    """An admin is moving its sessions off (``capsa nodes drain``): it gets no new sandboxes."""


class NodeEnrolTokenRow(Base):
    """A one-time node enrolment token; only its SHA-256 is stored."""

    __tablename__ = "node_enrol_tokens"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True)


class SessionRow(Base):
    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_tenant_created", "tenant", "created_at", "id"),
        Index("ix_sessions_state_expires", "state", "expires_at"),
        Index("ix_sessions_node_state", "node_id", "state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    template: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    idle_timeout: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_activity_at: Mapped[datetime] = mapped_column(UTCDateTime)
    memory_mib: Mapped[int] = mapped_column(Integer)
    vcpus: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sandbox_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    failure_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Snapshots (migration 0002). ``timeout_s`` is the lifetime asked for, re-applied on resume.
    timeout_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    on_timeout: Mapped[str] = mapped_column(String(8), default="close", server_default="close")
    keep_snapshots: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    snapshot_interval_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    snapshot_after_command: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    snapshot_keep: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Rolling snapshots kept; None: the session has no rolling snapshot policy."""
    snapshot_max_age_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Rolling snapshots older than this are deleted, the newest excepted (migration 0012)."""
    snapshot_wanted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    """Set when a command finished and the policy wants a snapshot after each command."""
    last_snapshot_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    snapshot_claim_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    """A replica taking a rolling snapshot holds this lease so no other replica takes one at once."""
    pause_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    env: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    """The session's environment, given again to every sandbox that resumes it."""
    # Migration 0007.
    expose: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    """The ports the port proxy may reach; None: any port."""


class SessionMetadataRow(Base):
    """One metadata pair per row so ``metadata.k=v`` filters are plain SQL on every database."""

    __tablename__ = "session_metadata"
    __table_args__ = (Index("ix_session_metadata_kv", "key", "value"),)

    session_id: Mapped[str] = mapped_column(String(32), ForeignKey("sessions.id", ondelete="CASCADE"),
                                            primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class RateCounterRow(Base):
    """Fixed-window request counters, shared by every replica through the database."""

    __tablename__ = "rate_counters"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    bucket: Mapped[str] = mapped_column(String(32), primary_key=True)
    window_start: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(Integer, default=0)


class SnapshotRow(Base):
    """A snapshot the control plane asked a node for; the files live on ``node_id``."""

    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_session_created", "session_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(String(32), ForeignKey("sessions.id", ondelete="CASCADE"))
    node_id: Mapped[str] = mapped_column(String(64))
    sandbox_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kind: Mapped[str] = mapped_column(String(16))
    """manual | rolling | pause | branch"""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    parent: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Migration 0012.
    stored: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    """In the fleet's store of ``node_id``: any node reporting the same store can restore it."""


class PortTokenRow(Base):
    """A per-session, per-port access token for the port proxy; only its SHA-256 is stored."""

    __tablename__ = "port_tokens"
    __table_args__ = (Index("ix_port_tokens_session", "session_id"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(String(32), ForeignKey("sessions.id", ondelete="CASCADE"))
    port: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)

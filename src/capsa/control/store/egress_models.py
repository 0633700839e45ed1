"""Tables of egress control: stored secrets, session policies and the egress audit trail."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from capsa.control.store.models import Base, UTCDateTime
from capsa.control.store.named import TenantNamed

__all__ = ["AuditCursorRow", "AuditDroppedRow", "AuditEventRow", "SecretRow", "SessionPolicyRow"]


class SecretRow(TenantNamed, Base):
    """A secret value, encrypted (``ciphertext``); the API never returns it."""

    __tablename__ = "secrets"

    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class SessionPolicyRow(Base):
    """A session's current egress policy (secret references by id); no row: the session has no network."""

    __tablename__ = "session_policies"

    session_id: Mapped[str] = mapped_column(String(32), ForeignKey("sessions.id", ondelete="CASCADE"),
                                            primary_key=True)
    policy: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    placeholders: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    """secret id -> the placeholder the session's guest holds for it (sent with every sandbox start)."""


class AuditEventRow(Base):
    """One egress event (request, DNS query, dropped packet class) collected from a node."""

    __tablename__ = "audit_events"
    __table_args__ = (
        UniqueConstraint("node_id", "node_epoch", "node_seq", name="uq_audit_events_node_seq"),
        Index("ix_audit_events_session", "session_id", "id"),
        Index("ix_audit_events_tenant", "tenant", "id"),
        Index("ix_audit_events_time", "time"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(String(32))
    sandbox_id: Mapped[str] = mapped_column(String(64))
    node_id: Mapped[str] = mapped_column(String(64))
    node_epoch: Mapped[str] = mapped_column(String(64))
    node_seq: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    decision: Mapped[str] = mapped_column(String(16))
    source: Mapped[str | None] = mapped_column(String(64), nullable=True)
    destination: Mapped[str | None] = mapped_column(Text, nullable=True)
    resolved_ip: Mapped[str | None] = mapped_column(String(64), nullable=True)
    method: Mapped[str | None] = mapped_column(String(16), nullable=True)
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    bytes_out: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_in: Mapped[int] = mapped_column(BigInteger, default=0)
    rule: Mapped[str | None] = mapped_column(Text, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    secret_ids: Mapped[list[str]] = mapped_column(JSON, default=list)
    count: Mapped[int] = mapped_column(Integer, default=1)


class AuditCursorRow(Base):
    """How far the node's audit log (of one node process, ``node_epoch``) has been copied (migration 0005)."""

    __tablename__ = "audit_cursors"

    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_epoch: Mapped[str] = mapped_column(String(64))
    node_seq: Mapped[int] = mapped_column(BigInteger)


class AuditDroppedRow(Base):
    """Events of a session that a node process dropped before they were collected (cumulative)."""

    __tablename__ = "audit_dropped"

    session_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_epoch: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)

"""Tables of the tenant audit chain: one hash-chained stream of events per tenant (migration 0008).

- ``audit_trail``: the events, keyed by (tenant, seq); each carries the hash of the tenant's previous event.
- ``audit_heads``: per tenant, the newest event's seq and hash. Every append locks and updates this row in
  the same transaction as its inserts, which serializes one tenant's appends across replicas.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from capsa.control.store.models import Base

__all__ = ["AuditHeadRow", "AuditTrailRow"]


class AuditTrailRow(Base):
    """One event of a tenant's chain (see :mod:`capsa.common.audit_chain` for its hash)."""

    __tablename__ = "audit_trail"
    __table_args__ = (
        Index("ix_audit_trail_session", "tenant", "session_id", "seq"),
        Index("ix_audit_trail_kind", "tenant", "kind", "seq"),
        Index("ix_audit_trail_time", "tenant", "time_us"),
        Index("ix_audit_trail_request", "tenant", "request_id"),
    )

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    time_us: Mapped[int] = mapped_column(BigInteger)
    """Microseconds since the Unix epoch (UTC)."""
    kind: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AuditHeadRow(Base):
    """The newest event of a tenant's chain (seq 0 and the genesis hash before the first)."""

    __tablename__ = "audit_heads"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(64))

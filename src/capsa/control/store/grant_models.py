"""Egress grants: which internal networks (of the nodes' ``CAPSA_EGRESS_ALLOW_NETWORKS``) a tenant's sandboxes
may reach. Written only through the admin API (``/v1/egress-grants``), each change chained into the granted
tenant's audit trail."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String, Text
from sqlalchemy.orm import Mapped, mapped_column

from capsa.control.store.models import Base, UTCDateTime

__all__ = ["EgressGrantRow"]


class EgressGrantRow(Base):
    __tablename__ = "egress_grants"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    network: Mapped[str] = mapped_column(String(64), primary_key=True)
    """A CIDR in canonical form (``10.20.0.0/16``)."""
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_by: Mapped[str] = mapped_column(String(32))
    """The id of the admin key that granted it."""

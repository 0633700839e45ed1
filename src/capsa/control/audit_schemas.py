"""Response bodies of the tenant audit chain API (``/v1/audit``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

__all__ = ["AuditChainEvent", "AuditChainList", "AuditVerifyOut"]


class AuditChainEvent(BaseModel):
    id: int
    """The event's number in the tenant's chain (1, 2, ...)."""
    time: datetime
    time_us: int
    """The same instant in microseconds since the Unix epoch, as hashed."""
    kind: str
    """``api``, ``session``, ``command``, ``file``, ``egress``, ``approval`` or ``connection``."""
    action: str
    tenant: str
    key_id: str | None
    request_id: str | None
    """The API request that caused it (the ``X-Request-Id`` its response carried)."""
    session_id: str | None
    detail: dict[str, Any] = Field(default_factory=dict)
    prev_hash: str
    hash: str


class AuditChainList(BaseModel):
    items: list[AuditChainEvent]
    next_cursor: str | None = None


class AuditVerifyOut(BaseModel):
    ok: bool
    checked: int
    """Events whose link and hash checked out before the first break (all of them when ``ok``)."""
    head: int
    """The id of the chain's newest event (0: no events yet)."""
    broken_id: int | None = None
    """The first event that is missing or does not check out."""
    reason: str | None = None

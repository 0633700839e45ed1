"""Answers of the tenant audit chain API (``/v1/audit``): the events, a verification, a signed checkpoint."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from pydantic import Field

from capsa.common.wire.base import Answer

__all__ = ["AUDIT_KINDS", "AuditChainEvent", "AuditChainList", "AuditCheckpointOut", "AuditKind",
           "AuditVerifyOut"]

AuditKind = Literal["api", "session", "command", "file", "egress", "approval", "connection"]
"""What an event of the chain records (its ``kind``)."""
AUDIT_KINDS: tuple[str, ...] = get_args(AuditKind)


class AuditChainEvent(Answer):
    id: int
    """The event's number in the tenant's chain (1, 2, ...)."""
    time: datetime
    time_us: int
    """The same instant in microseconds since the Unix epoch, as hashed."""
    kind: str
    """One of :data:`AUDIT_KINDS`."""
    action: str
    tenant: str
    key_id: str | None
    request_id: str | None
    """The API request that caused it (the ``X-Request-Id`` its response carried)."""
    session_id: str | None
    detail: dict[str, Any] = Field(default_factory=dict)
    prev_hash: str
    hash: str


class AuditChainList(Answer):
    items: list[AuditChainEvent]
    next_cursor: str | None = None


class AuditVerifyOut(Answer):
    ok: bool
    checked: int
    """Events whose link and hash checked out before the first break (all of them when ``ok``)."""
    head: int
    """The id of the chain's newest event (0: no events yet)."""
    broken_id: int | None = None
    """The first event that is missing or does not check out."""
    reason: str | None = None
    code: str | None = None
    """Why it is not ``ok``, stable: ``audit_chain_broken`` (an event missing, edited or out of place),
    ``audit_chain_truncated`` (the chain ends before the event a signed checkpoint vouches for: its tail
    was cut, or the tenant's chain deleted) or ``audit_checkpoint_invalid`` (the checkpoint log itself
    does not check out: a line forged without the key, edited or removed)."""
    anchor: int | None = None
    """The highest event a signed checkpoint vouches for, which the chain was checked against (None: no
    checkpoint yet, or checkpoints are not configured: a cut tail would then go unnoticed)."""


class AuditCheckpointOut(Answer):
    n: int
    """The checkpoint's line in the anchor log."""
    tenant: str
    seq: int
    """The event of the tenant's chain it vouches for (0: the chain is empty)."""
    hash: str
    time: datetime
    purpose: str
    """``head`` or ``retention``."""
    key: str
    """The id of the Ed25519 key that signed it."""

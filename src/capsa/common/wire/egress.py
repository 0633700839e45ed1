"""Answers of the egress API: stored secrets (never their values), a session's policy and its egress audit
trail (``/v1/secrets``, ``/v1/sessions/{id}/policy``, ``/v1/sessions/{id}/audit``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from capsa.common.wire.base import Answer, known

__all__ = ["AuditEventOut", "AuditList", "EgressDecision", "EgressKind", "PolicyOut", "SecretList",
           "SecretOut"]

EgressKind = Literal["http", "connect", "tls", "dns", "net", "approval", "connection"]
"""What an egress event records: traffic (``http`` ... ``net``, dropped packets of one class), an
``approval`` decided, or an OAuth ``connection``'s token injected, refreshed or revoked."""
EgressDecision = Literal["allow", "deny", "error"]


class SecretOut(Answer):
    id: str
    name: str
    description: str | None
    created_at: datetime


class SecretList(Answer):
    items: list[SecretOut]


class PolicyOut(Answer):
    session_id: str
    policy: dict[str, Any] | None
    """None: the session was created without a policy and has no network."""
    updated_at: datetime | None
    ca_reissued: bool = False
    """Set by an update that added domains the sandbox's CA did not cover (a new CA was installed)."""


class AuditEventOut(Answer):
    id: int
    session_id: str
    sandbox_id: str
    time: datetime
    kind: Annotated[str, known(EgressKind)]
    """One of :data:`EgressKind`."""
    decision: Annotated[str, known(EgressDecision)]
    """``allow``, ``deny`` or ``error``."""
    source: str | None
    destination: str | None
    resolved_ip: str | None
    method: str | None
    path: str | None
    status: int | None
    bytes_out: int
    bytes_in: int
    rule: str | None
    reason: str | None
    secret_ids: list[str]
    """Secrets injected into this request (ids, never values)."""
    count: int
    """For ``net`` events: packets dropped since the previous event of the class; for denials: how many
    identical denials (same destination, rule and reason) this event stands for."""


class AuditList(Answer):
    items: list[AuditEventOut]
    next_cursor: str | None
    dropped: int = 0
    """Events of this session its node discarded before the control plane collected them (the sandbox
    filled its share of the node's audit buffer); they are missing from ``items``."""

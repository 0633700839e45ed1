"""Egress audit events: one structured record per HTTP request, DNS query and blocked packet class.

Records name the secret that was injected, never its value. They go to a pluggable sink (a callback):
the node agent forwards them to the control plane's audit trail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from capsa.common.wire.egress import EgressDecision, EgressKind

__all__ = ["AuditSink", "EgressEvent", "ListSink", "emit_safely"]

_log = logging.getLogger(__name__)


class EgressEvent(BaseModel):
    kind: EgressKind
    """``approval`` and ``connection`` events go into the tenant chain under those kinds."""
    session_id: str | None = None
    sandbox_id: str
    time: float = Field(default_factory=time.time)
    source: str | None = None
    """The sandbox address the traffic came from."""
    destination: str | None = None
    """Host name (and port) the sandbox asked for; for ``net`` events the packet class."""
    resolved_ip: str | None = None
    method: str | None = None
    path: str | None = None
    status: int | None = None
    bytes_out: int = 0
    """Request bytes sent upstream (body)."""
    bytes_in: int = 0
    """Response bytes returned to the sandbox (body)."""
    decision: EgressDecision
    rule: str | None = None
    """The policy rule (domain pattern) or network rule behind the decision."""
    reason: str | None = None
    secret_ids: list[str] = Field(default_factory=list)
    count: int = 1
    """For ``net`` events: packets dropped since the previous event of this class."""
    detail: dict[str, Any] | None = None
    """Approval and connection events: what was decided or used (JSON values; an ``action`` string, if
    present, becomes the chain event's action). Never a secret or token value."""
    request_id: str | None = None
    """The control-plane API request that caused the event (e.g. the approval decision), when one did."""


AuditSink = Callable[[EgressEvent], None]


class ListSink:
    """Collects events in memory (tests, diagnostics)."""

    def __init__(self) -> None:
        self.events: list[EgressEvent] = []

    def __call__(self, event: EgressEvent) -> None:
        self.events.append(event)

    def find(self, **match: object) -> list[EgressEvent]:
        return [e for e in self.events if all(getattr(e, k) == v for k, v in match.items())]


def emit_safely(sink: AuditSink, event: EgressEvent) -> None:
    """A failing sink must not take the broker down, nor let a request through unlogged silently."""
    try:
        sink(event)
    except Exception:
        _log.exception("egress audit sink failed for a %s event of %s", event.kind, event.sandbox_id)

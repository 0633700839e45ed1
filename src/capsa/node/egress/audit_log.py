"""The node's buffer of egress audit events, read by the control plane over the node API.

The control plane pulls rather than the node pushing: the node API is the only channel between them, and a
pull after each sandbox's end (and on every audit query) loses nothing a push could lose to a busy or
restarting control plane. Each event gets a sequence number; ``epoch`` changes with every node process, so
a reader holding a cursor from a previous process starts over instead of skipping events.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass

from capsa.node.egress.audit import EgressEvent

__all__ = ["AuditLog", "AuditPage"]


@dataclass(frozen=True)
class AuditPage:
    epoch: str
    events: list[tuple[int, EgressEvent]]
    last_seq: int
    """The highest sequence number handed out so far (the cursor to use when ``events`` is empty)."""
    lost: int
    """Events that fell out of the buffer before this reader asked for them."""


class AuditLog:
    """An :data:`~capsa.node.egress.audit.AuditSink`: numbered, bounded, in memory."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.epoch = secrets.token_hex(8)
        self._events: deque[tuple[int, EgressEvent]] = deque(maxlen=capacity)
        self._seq = 0

    def __call__(self, event: EgressEvent) -> None:
        self._seq += 1
        self._events.append((self._seq, event))

    def read(self, after: int, epoch: str | None, limit: int) -> AuditPage:
        if epoch != self.epoch:
            after = 0  # a cursor from another node process: everything here is new to the reader
        oldest = self._events[0][0] if self._events else self._seq + 1
        lost = max(0, oldest - after - 1) if after < oldest else 0
        page = [(seq, ev) for seq, ev in self._events if seq > after][:limit]
        return AuditPage(self.epoch, page, self._seq, lost)

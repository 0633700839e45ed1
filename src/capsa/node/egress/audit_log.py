"""The node's buffer of egress audit events, read by the control plane over the node API.

The control plane pulls rather than the node pushing: the node API is the only channel between them, and a
pull after each sandbox's end (and on every heartbeat) loses nothing a push could lose to a busy or
restarting control plane. Each event gets a sequence number; ``epoch`` changes with every node process, so
a reader holding a cursor from a previous process starts over instead of skipping events.

A sandbox cannot flood the buffer at another's expense (security finding 8):

- **Denials are aggregated.** A denial with the same sandbox, kind, destination, rule and reason as one
  recorded less than ``aggregate_window`` seconds ago, and not yet handed to a reader, adds to that event's
  ``count`` instead of taking a slot. A sandbox hammering a refused host costs one event per collection.
- **Each sandbox has a share.** A sandbox holds at most ``per_sandbox`` events; past it, its own oldest event
  goes. When the whole buffer (``capacity``) is full, the oldest event of the sandbox holding the most goes,
  so a sandbox with few events never loses them to one with many.
- **Drops are counted.** An event that goes before any reader collected it is counted per session
  (:attr:`AuditPage.dropped`, cumulative in the epoch), so the audit API can say what is missing.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from capsa.node.egress.audit import EgressEvent

__all__ = ["AuditLog", "AuditPage"]

_AggregateKey = tuple[str, str, str | None, str | None, str | None]

_MAX_DROPPED_SESSIONS = 10_000
"""Sessions whose drop counts are kept; past it the oldest entry goes (its count was reported long ago)."""


@dataclass(frozen=True)
class AuditPage:
    epoch: str
    events: list[tuple[int, EgressEvent]]
    last_seq: int
    """The highest sequence number handed out so far (the cursor to use when ``events`` is empty)."""
    lost: int
    """Events of this epoch that left the buffer before any reader collected them (all sandboxes)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """The same, per session id (cumulative in the epoch; sessions with no drop are absent)."""


class AuditLog:
    """An :data:`~capsa.node.egress.audit.AuditSink`: numbered, bounded, in memory, fair between sandboxes."""

    def __init__(self, capacity: int = 100_000, per_sandbox: int | None = None,
                 aggregate_window: float = 60.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.epoch = secrets.token_hex(8)
        self.capacity = capacity
        share = per_sandbox if per_sandbox is not None else max(capacity // 10, min(capacity, 1000))
        self.per_sandbox = max(1, min(capacity, share))
        self.aggregate_window = aggregate_window
        self._events: dict[int, EgressEvent] = {}  # insertion order is seq order
        self._by_sandbox: dict[str, deque[int]] = {}
        self._open: dict[_AggregateKey, tuple[int, float]] = {}  # key -> (seq, time of its first denial)
        self._seq = 0
        self._handed_out = 0
        self._lost = 0
        self._dropped: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._events)

    def __call__(self, event: EgressEvent) -> None:
        if event.decision == "deny" and self._aggregated(event):
            return
        self._seq += 1
        seq = self._seq
        self._events[seq] = event
        mine = self._by_sandbox.setdefault(event.sandbox_id, deque())
        mine.append(seq)
        if event.decision == "deny":
            self._open[self._key(event)] = (seq, event.time)
        if len(mine) > self.per_sandbox:
            self._evict(event.sandbox_id)
        if len(self._events) > self.capacity:
            self._evict(max(self._by_sandbox, key=lambda sbx: len(self._by_sandbox[sbx])))

    @staticmethod
    def _key(event: EgressEvent) -> _AggregateKey:
        return (event.sandbox_id, event.kind, event.destination, event.rule, event.reason)

    def _aggregated(self, event: EgressEvent) -> bool:
        key = self._key(event)
        found = self._open.get(key)
        if found is None:
            return False
        seq, first = found
        held = self._events.get(seq)
        if held is None or seq <= self._handed_out or event.time - first >= self.aggregate_window:
            del self._open[key]  # collected, evicted or too old: the next denial starts a new event
            return False
        held.count += event.count
        held.time = max(held.time, event.time)
        return True

    def _evict(self, sandbox_id: str) -> None:
        mine = self._by_sandbox[sandbox_id]
        seq = mine.popleft()
        if not mine:
            del self._by_sandbox[sandbox_id]
        event = self._events.pop(seq)
        if seq > self._handed_out:
            self._lost += event.count if event.decision == "deny" else 1
            if event.session_id:
                self._count_drop(event.session_id, event.count if event.decision == "deny" else 1)

    def _count_drop(self, session_id: str, n: int) -> None:
        self._dropped[session_id] = self._dropped.get(session_id, 0) + n
        self._dropped.move_to_end(session_id)
        while len(self._dropped) > _MAX_DROPPED_SESSIONS:
            self._dropped.popitem(last=False)

    def read(self, after: int, epoch: str | None, limit: int) -> AuditPage:
        if epoch != self.epoch:
            after = 0  # a cursor from another node process: everything here is new to the reader
        page: list[tuple[int, EgressEvent]] = []
        if after < self._seq:
            for seq, event in self._events.items():
                if seq > after:
                    # A copy: later denials aggregate into a new event once this one is handed out.
                    page.append((seq, event.model_copy()))
                    if len(page) >= limit:
                        break
        if page:
            self._handed_out = max(self._handed_out, page[-1][0])
        return AuditPage(self.epoch, page, self._seq, self._lost, dict(self._dropped))

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

**Durable when given a file** (``path``; the node agent uses ``<state_dir>/egress-audit.jsonl``, 0600): every
event, aggregation update and removal is appended as a JSON line (flushed to the kernel at once, so a
killed node process loses nothing; no fsync, so a power cut can lose the last lines). A new process on the
same file reloads the events and keeps the epoch and numbering, so the control plane's cursor stays valid
and events not yet collected are still handed out. :meth:`AuditLog.acknowledge` (the control plane's
cursor, sent with every read) prunes what it has stored; the file is rewritten once mostly dead lines.
Per-session drop counts are not kept across processes (``lost`` is).
"""

from __future__ import annotations

import json
import os
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.metrics import EgressMetrics

__all__ = ["AUDIT_FILE", "AuditLog", "AuditPage"]

AUDIT_FILE = "egress-audit.jsonl"
"""The durable buffer's name in the node's state directory."""

_AggregateKey = tuple[str, str, str | None, str | None, str | None]

_MAX_DROPPED_SESSIONS = 10_000
"""Sessions whose drop counts are kept; past it the oldest entry goes (its count was reported long ago)."""


def _parse_line(line: str) -> dict[str, Any] | None:
    """One line of the file; None for a torn last line (a process killed mid-write) or garbage."""
    try:
        parsed = json.loads(line)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


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
                 aggregate_window: float = 60.0, path: Path | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.epoch = secrets.token_hex(8)
        self.path = path
        self._file: IO[str] | None = None
        self._lines = 0
        self._dirty: set[int] = set()  # aggregated events whose new count is not on disk yet
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
        self.metrics = EgressMetrics()
        """Every decision recorded here, counted (aggregated denials each count)."""
        if path is not None:
            self._load(path)

    # -- the file --------------------------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        if path.exists():
            with path.open(encoding="utf-8") as handle:
                lines = [parsed for parsed in map(_parse_line, handle) if parsed is not None]
            loaded: dict[int, EgressEvent] = {}
            for line in lines:
                if "epoch" in line:
                    self.epoch = str(line["epoch"])
                    self._seq = max(self._seq, int(line.get("seq", 0)))
                    self._lost = int(line.get("lost", 0))
                elif "event" in line:
                    loaded[int(line["seq"])] = EgressEvent.model_validate(line["event"])
                elif "gone" in line:
                    loaded.pop(int(line["gone"]), None)
                    self._lost = int(line.get("lost", self._lost))
                elif "upto" in line:
                    upto = int(line["upto"])
                    loaded = {seq: ev for seq, ev in loaded.items() if seq > upto}
            for seq in sorted(loaded):
                self._seq = max(self._seq, seq)
                self._events[seq] = loaded[seq]
                self._by_sandbox.setdefault(loaded[seq].sandbox_id, deque()).append(seq)
            # Events of a previous process may have been handed out: none of them takes aggregates.
            self._handed_out = self._seq
        self._rewrite()

    def _rewrite(self) -> None:
        """Replace the file with the live events only (atomically)."""
        assert self.path is not None
        if self._file is not None:
            self._file.close()
        temporary = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps({"epoch": self.epoch, "seq": self._seq, "lost": self._lost}) + "\n")
            for seq, event in self._events.items():
                out.write(json.dumps({"seq": seq, "event": event.model_dump(mode="json")}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        self._dirty.clear()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lines = 1 + len(self._events)

    def _log(self, line: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._lines += 1
        if self._lines > 2 * len(self._events) + 1000:  # mostly dead lines: amortised O(1) per line
            self._rewrite()

    def _write_dirty(self) -> None:
        for seq in sorted(self._dirty):
            held = self._events.get(seq)
            if held is not None:
                self._log_event(seq, held)
        self._dirty.clear()

    def _log_event(self, seq: int, event: EgressEvent) -> None:
        if self._file is not None:
            self._log({"seq": seq, "event": event.model_dump(mode="json")})

    def acknowledge(self, epoch: str | None, upto: int) -> int:
        """The reader has stored every event up to ``upto`` of ``epoch``: drop them (and from the file).
        Returns how many went. A cursor of another epoch acknowledges nothing."""
        if epoch != self.epoch or upto <= 0:
            return 0
        gone = [seq for seq in self._events if seq <= upto]
        if not gone:
            return 0
        for seq in gone:
            event = self._events.pop(seq)
            mine = self._by_sandbox.get(event.sandbox_id)
            if mine is not None:
                while mine and mine[0] <= upto:
                    mine.popleft()
                if not mine:
                    del self._by_sandbox[event.sandbox_id]
        self._handed_out = max(self._handed_out, upto)
        self._dirty.difference_update(gone)
        self._log({"upto": upto})
        return len(gone)

    def close(self) -> None:
        if self._file is not None:
            self._write_dirty()
            self._file.close()
            self._file = None

    def __len__(self) -> int:
        return len(self._events)

    def __call__(self, event: EgressEvent) -> None:
        self.metrics.record(event)
        if event.decision == "deny" and self._aggregated(event):
            return
        self._seq += 1
        seq = self._seq
        self._events[seq] = event
        self._log_event(seq, event)
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
        if self._file is not None:
            self._dirty.add(seq)  # written before it is handed out: a hammered denial costs no disk write
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
        self._log({"gone": seq, "lost": self._lost})

    def _count_drop(self, session_id: str, n: int) -> None:
        self._dropped[session_id] = self._dropped.get(session_id, 0) + n
        self._dropped.move_to_end(session_id)
        while len(self._dropped) > _MAX_DROPPED_SESSIONS:
            self._dropped.popitem(last=False)

    def read(self, after: int, epoch: str | None, limit: int) -> AuditPage:
        self._write_dirty()
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

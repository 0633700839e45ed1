"""Running sessions as this replica last read them, so a command does not read the database to find its
sandbox (``CAPSA_SESSION_CACHE_SECONDS``).

What a command needs from its session's row (tenant, state, sandbox and node) changes only when the
session leaves ``running``, and every such change also ends or replaces the sandbox on the node: the node
then refuses a call to it (``sandbox_not_found``), which :func:`~capsa.control.sessions.relay.session_error`
answers by forgetting the entry and reading the row again. So a stale entry never runs a command in a
sandbox the session no longer has; it can only send one call to the node before the error the session's
current state gives. Transitions through this replica forget the entry at once; a session closed or
paused through another replica is sent at most that one call per ``ttl``. A command that reaches the node
while a close or pause is under way runs before it, exactly as one that read the row a moment earlier.

Not cached: sessions with rolling snapshots (their activity stamps are decided against the latest
snapshot's time, which another replica may have changed) and anything not running on a node. Entries
live ``ttl`` seconds (0 disables the cache), at most ``capacity`` of them, least recently used dropped
first. The cached rows are detached and shared between requests: callers read them, never change them
(the activity stamp is the one field changed, by the call that writes it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from capsa.control.store.models import NodeRow, SessionRow

__all__ = ["SessionCache"]


@dataclass
class _Entry:
    row: SessionRow
    node: NodeRow
    until: float


class SessionCache:
    def __init__(self, ttl: float, capacity: int = 4096) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def lookup(self, session_id: str) -> tuple[SessionRow, NodeRow] | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.until <= time.monotonic():
            del self._entries[session_id]
            return None
        self._entries.move_to_end(session_id)
        return entry.row, entry.node

    def store(self, row: SessionRow, node: NodeRow | None) -> None:
        """Remember a row just read (it must not be used by a database session any more)."""
        if (self.ttl <= 0 or node is None or row.state != "running" or not row.sandbox_id
                or row.snapshot_keep is not None):
            return
        self._entries[row.id] = _Entry(row, node, time.monotonic() + self.ttl)
        self._entries.move_to_end(row.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def forget(self, session_id: str) -> bool:
        """Drop the session's entry; whether there was one."""
        return self._entries.pop(session_id, None) is not None

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

from capsa.control.store.models import NodeRow, SessionRow
from capsa.control.ttl_cache import TtlCache

__all__ = ["SessionCache"]


class SessionCache(TtlCache[str, tuple[SessionRow, NodeRow]]):
    def store(self, row: SessionRow, node: NodeRow | None) -> None:
        """Remember a row just read (it must not be used by a database session any more)."""
        if node is None or row.state != "running" or not row.sandbox_id or row.snapshot_keep is not None:
            return
        self.put(row.id, (row, node))

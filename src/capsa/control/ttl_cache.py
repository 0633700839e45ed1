"""A bounded map whose entries expire: what this replica last read, trusted for a while.

:class:`TtlCache` holds at most ``capacity`` entries for ``ttl`` seconds each (monotonic clock), least
recently used dropped first; ``ttl`` 0 (or less) keeps nothing. The API key cache (:mod:`capsa.control.auth`)
and the running-session cache (:mod:`capsa.control.sessions.cache`) are built on it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["TtlCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, ttl: float, capacity: int = 4096) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self._entries: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def lookup(self, key: K) -> V | None:
        """The value stored for ``key`` if it has not expired (an expired one is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, until = entry
        if until <= time.monotonic():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Remember ``value`` for ``ttl`` seconds from now (nothing when ``ttl`` is 0)."""
        if self.ttl <= 0:
            return
        self._entries[key] = (value, time.monotonic() + self.ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def forget(self, key: K) -> bool:
        """Drop the entry for ``key``; whether there was one."""
        return self._entries.pop(key, None) is not None

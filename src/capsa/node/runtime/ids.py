"""Allocating the numeric identities VMs run with: VM uids and the groups of branch RAM files.

Each live VM must have a uid no other VM has (the kernel's only wall between two compromised QEMUs), and
each set of branches that map one frozen RAM file privately gets a group no other set shares. Picking at
random is not enough: :class:`IdAllocator` remembers what is handed out until it is released, and skips
ids the caller reports as taken on disk (left by a previous node process).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable

from capsa.common.errors import CapsaError

__all__ = ["IdAllocator", "IdsExhausted"]

_RANDOM_TRIES = 64


class IdsExhausted(CapsaError):
    code = "ids_exhausted"
    status = 503


class IdAllocator:
    """Hands out ids from ``[base, base + count)``, each to one holder at a time. Thread-safe."""

    def __init__(self, base: int, count: int, what: str) -> None:
        if count < 1:
            raise ValueError("an id range needs at least one id")
        self.base = base
        self.count = count
        self.what = what
        self._live: set[int] = set()
        self._lock = threading.Lock()

    def __contains__(self, value: object) -> bool:
        return value in self._live

    @property
    def live(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._live)

    def owns(self, value: int) -> bool:
        """Whether ``value`` is inside this allocator's range."""
        return self.base <= value < self.base + self.count

    def allocate(self, taken: Iterable[int] = ()) -> int:
        """A fresh id, not live here and not in ``taken``; random, so ids are not predictable."""
        with self._lock:
            busy = self._live | {t for t in taken if self.owns(t)}
            if len(busy) >= self.count:
                raise IdsExhausted(f"no free {self.what}: all {self.count} are in use")
            for _ in range(_RANDOM_TRIES):
                value = self.base + secrets.randbelow(self.count)
                if value not in busy:
                    break
            else:  # a nearly full range: take the first free id after a random start
                start = secrets.randbelow(self.count)
                value = next(self.base + (start + i) % self.count for i in range(self.count)
                             if self.base + (start + i) % self.count not in busy)
            self._live.add(value)
            return value

    def release(self, value: int) -> None:
        """Give ``value`` back (idempotent)."""
        with self._lock:
            self._live.discard(value)

"""Per-key fixed-window rate limits counted in the database, claimed by each replica in leases.

Every replica counts against the same database row per (key, bucket, window), so the limit holds across
replicas. A request does not write that row each time: the replica claims a *lease* of up to ``lease``
units at once (one ``UPDATE … SET count = count + n``) and spends it from memory. Bounds (ARCHITECTURE.md,
"Control plane"):

* never more than ``limit`` units are admitted per key and window across all replicas (a lease is only
  granted from what the row still has room for);
* a replica holds at most ``lease - 1`` unspent units at a time, so with R replicas a key can be refused
  at most ``(R - 1) * (lease - 1)`` units before its limit (units another replica claimed and has not used
  yet), and only within that window;
* database writes: one per ``lease`` admitted units, plus one per replica and window when it finds the
  window full (the refusals after that cost none).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from capsa.control.errors import RateLimited
from capsa.control.store.db import DbSession
from capsa.control.store.models import RateCounterRow

__all__ = ["DEFAULT_LEASE", "RateLimiter", "lease_size", "prune"]

DEFAULT_LEASE = 16
_MAX_TRACKED = 10_000  # leases kept in memory before those of past windows are dropped


def lease_size(limit: int, most: int) -> int:
    """Units one claim takes: at most ``most`` and at most 1/20 of the limit (so leases held unspent by
    other replicas cannot refuse a key much before its limit), at least 1."""
    return max(1, min(most, limit // 20))


@dataclass
class _Lease:
    window_start: int
    remaining: int = 0
    full: bool = False


class RateLimiter:
    """This replica's leases on the shared counters (one per control plane process)."""

    def __init__(self, lease: int = DEFAULT_LEASE) -> None:
        if lease < 1:
            raise ValueError("lease must be at least 1")
        self.lease = lease
        self._leases: dict[tuple[str, str], _Lease] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.claims = 0
        """Database claims made so far (each is one write)."""

    async def hit(self, db: async_sessionmaker[DbSession], key_id: str, bucket: str, limit: int, window: int,
                  cost: int = 1) -> None:
        """Count one request (``cost`` units: a branch into n sessions counts n); raise
        :class:`RateLimited` (with Retry-After) when the window is full."""
        now = time.time()
        start = int(now // window) * window
        ident = (key_id, bucket)
        if self._spend(ident, start, cost):
            return
        async with self._locks.setdefault(ident, asyncio.Lock()):
            if self._spend(ident, start, cost):  # another request of this replica claimed meanwhile
                return
            lease = self._current(ident, start)
            if not lease.full:
                want = max(lease_size(limit, self.lease), cost - lease.remaining)
                granted = await self._claim(db, key_id, bucket, start, limit, want)
                lease.remaining += granted
                lease.full = granted < want  # the row has no room left in this window
                if self._spend(ident, start, cost):
                    return
                lease.full = True
        raise RateLimited(f"more than {limit} {bucket} requests in {window} s for this key",
                          retry_after=max(1, int(start + window - now + 0.999)))

    def _current(self, ident: tuple[str, str], start: int) -> _Lease:
        lease = self._leases.get(ident)
        if lease is None or lease.window_start != start:
            # A new window: what was left of the old lease was counted there and lapses with it.
            if len(self._leases) >= _MAX_TRACKED:
                self._leases = {k: v for k, v in self._leases.items() if v.window_start >= start}
                self._locks = {k: v for k, v in self._locks.items() if k in self._leases or v.locked()}
            lease = self._leases[ident] = _Lease(start)
        return lease

    def _spend(self, ident: tuple[str, str], start: int, cost: int) -> bool:
        lease = self._current(ident, start)
        if lease.remaining >= cost:
            lease.remaining -= cost
            return True
        return False

    async def _claim(self, factory: async_sessionmaker[DbSession], key_id: str, bucket: str, start: int,
                     limit: int, want: int) -> int:
        """Add ``want`` to the window's row; returns how many of them fit under ``limit``."""
        self.claims += 1
        async with factory() as db:
            for _ in range(3):
                # Increment first: the UPDATE is atomic on every database, a read-then-write would not be.
                result = await db.execute(
                    update(RateCounterRow)
                    .where(RateCounterRow.key_id == key_id, RateCounterRow.bucket == bucket,
                           RateCounterRow.window_start == start)
                    .values(count=RateCounterRow.count + want)
                    .returning(RateCounterRow.count)
                )
                count = result.scalar_one_or_none()
                if count is None:
                    try:
                        async with db.begin_nested():
                            db.add(RateCounterRow(key_id=key_id, bucket=bucket, window_start=start,
                                                  count=want))
                        count = want
                    except IntegrityError:
                        continue  # another replica created the row first: increment it instead
                await db.commit()
                return max(0, min(want, limit - (count - want)))
        raise RateLimited(f"{bucket} rate limit contention", retry_after=1)


async def prune(db: DbSession, older_than: float) -> None:
    await db.execute(delete(RateCounterRow).where(RateCounterRow.window_start < int(older_than)))
    await db.commit()

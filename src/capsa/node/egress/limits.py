"""What the broker lets one sandbox, and all of them together, hold: connections, file descriptors,
buffered bytes and time.

* Connections: a cap per sandbox and one for the node; the node cap is also bounded by ``RLIMIT_NOFILE``
  (each connection holds two descriptors: the sandbox side and the upstream), which :func:`raise_nofile`
  lifts to the hard limit at node start.
* Buffered bytes: every body transfer reserves the most it can hold in memory (read chunk, write buffer,
  redaction window) from its sandbox's budget and from the node's before it moves a byte, and waits
  (bounded by its deadline) while either is spent. Bodies stream; nothing reads a whole body, except a
  request held for approval, whose bytes are charged to the same budgets while it is held.
* Time: a request head must arrive whole within ``head_timeout`` (``idle_timeout`` for later requests on a
  kept-alive connection), whatever the pace of its bytes; a body must keep ``min_rate`` bytes/s, with at most
  ``rate_grace`` seconds of slack. Trickling cannot hold a connection open for long.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass

__all__ = ["DNS_QUERIES_PER_SECOND", "BrokerLimits", "ByteBudget", "Pace", "TokenBucket", "raise_nofile"]

KiB = 1024
MiB = 1024 * KiB
DNS_QUERIES_PER_SECOND = 100
"""What one sandbox may ask its DNS stub (twice that as a burst)."""


@dataclass(frozen=True)
class BrokerLimits:
    connections_per_sandbox: int = 256
    connections_total: int = 4096
    buffer_bytes_per_sandbox: int = 32 * MiB
    buffer_bytes_total: int = 256 * MiB
    read_chunk: int = 64 * KiB
    """Largest piece read from either side at once; also the transport's write high-water mark."""
    head_timeout: float = 30.0
    idle_timeout: float = 120.0
    upstream_timeout: float = 60.0
    """Longest wait for an upstream's response head."""
    min_rate: float = 1024.0
    rate_grace: float = 30.0
    fds_reserved: int = 256
    """Descriptors kept back for everything else the node opens (disks, sockets, QEMU)."""

    def connection_cap(self) -> int:
        """The node-wide connection cap, never more than the open-file limit allows."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.connections_total
        return max(1, min(self.connections_total, (soft - self.fds_reserved) // 2))


def raise_nofile() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


class ByteBudget:
    """A pool of bytes that transfers reserve from and give back; ``parent`` is charged as well."""

    def __init__(self, limit: int, parent: ByteBudget | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.parent = parent
        self._changed = asyncio.Event()

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit and (self.parent is None or self.parent._fits(n))

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if self.parent is not None:
            self.parent._take(n)

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()
        self._changed = asyncio.Event()
        if self.parent is not None:
            self.parent.release(n)

    def _events(self) -> list[asyncio.Event]:
        return [self._changed] + (self.parent._events() if self.parent is not None else [])

    async def reserve(self, n: int, wait_s: float) -> None:
        """Take ``n`` bytes, waiting up to ``wait_s`` seconds for them (``TimeoutError`` after)."""
        async with asyncio.timeout(wait_s):
            while not self._fits(n):
                waits = [asyncio.ensure_future(e.wait()) for e in self._events()]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        self._take(n)


class Pace:
    """The deadline of a transfer that must keep ``min_rate`` bytes/s: each byte buys ``1/min_rate`` seconds,
    and no transfer gets more than ``grace`` seconds ahead (a burst cannot buy an hour of trickling)."""

    def __init__(self, min_rate: float, grace: float) -> None:
        self.min_rate, self.grace = min_rate, grace
        self.deadline = time.monotonic() + grace
        self.bytes = 0

    def add(self, n: int) -> None:
        now = time.monotonic()
        self.bytes += n
        self.deadline = min(max(self.deadline, now) + n / self.min_rate, now + self.grace)

    def remaining(self) -> float:
        """Seconds left before the transfer falls below the minimum rate (``TimeoutError`` once none)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("transfer below the minimum rate")
        return left


class TokenBucket:
    """A request rate: ``per_minute`` on average, ``burst`` (default: ``per_minute``) at once."""

    def __init__(self, per_minute: int, burst: int | None) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(burst or per_minute)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

"""The warm pool: per template, sandboxes restored ahead of time and idle until a request binds one.

A pooled sandbox is handed out exactly once and never comes back: after a user had it, it is destroyed
like any other. Identity is given at bind time (:func:`~capsa.node.guestlink.identity.bind_identity`), not
when it was restored: a fresh forced CRNG reseed, the clock and the hostname. An empty pool is not an
error: the caller restores on demand (a miss). Refills run in the background, one restore at a time across
the node, because a restore is CPU-bound under TCG and would otherwise slow down the requests being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from capsa.node.runtime.base import Sandbox, SandboxState

__all__ = ["PoolKey", "PoolMetrics", "PoolSettings", "WarmPool"]

log = logging.getLogger(__name__)

PoolKey = tuple[str, int, int]
"""(template name, memory MiB, vCPUs)"""

RestoreFn = Callable[[PoolKey], Awaitable[Sandbox]]
DestroyFn = Callable[[Sandbox], Coroutine[object, object, None]]

_RETRY_DELAYS = (1.0, 5.0, 30.0)


class PoolSettings(BaseSettings):
    """``CAPSA_POOL_SIZE`` (idle sandboxes per template, default 1), ``CAPSA_POOL_SIZES`` (JSON object
    of per-template overrides, e.g. ``{"base": 2, "py": 0}``) and ``CAPSA_POOL_REFILL_DELAY`` (seconds a
    refill waits after the last sandbox was taken, default 1)."""

    model_config = SettingsConfigDict(env_prefix="CAPSA_POOL_", extra="ignore")

    size: int = Field(default=1, ge=0, le=64)
    sizes: dict[str, int] = Field(default_factory=dict)
    refill_delay: float = Field(default=1.0, ge=0, le=60)


class PoolMetrics:
    """Prometheus series for the pool, in a registry of the node's own (one per agent)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["template", "memory_mib", "vcpus"]
        self.idle = Gauge("capsa_pool_idle", "Restored sandboxes waiting in the warm pool", labels,
                          registry=self.registry)
        self.target = Gauge("capsa_pool_target", "Configured warm pool size", labels, registry=self.registry)
        self.hits = Counter("capsa_pool_hits", "Creations served from the warm pool", labels,
                            registry=self.registry)
        self.misses = Counter("capsa_pool_misses", "Creations restored on demand (pool empty)", labels,
                              registry=self.registry)
        self.refill_failures = Counter("capsa_pool_refill_failures", "Background restores that failed",
                                       labels, registry=self.registry)
        self.create_seconds = Histogram(
            "capsa_sandbox_create_seconds", "Time to create a sandbox, by how it was made", ["source"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=self.registry)


@dataclass
class _Slot:
    key: PoolKey
    target: int
    idle: deque[Sandbox] = field(default_factory=deque)
    restoring: int = 0
    hits: int = 0
    misses: int = 0
    failures: int = 0
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    taken_at: float = float("-inf")
    loading: bool = False
    """A refill's restore of this key is running (not only queued behind another key's)."""
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    """Takers waiting for the restore that is running (:meth:`WarmPool.take_soon`)."""

    def wake_waiters(self, n: int | None = None) -> None:
        while self.waiters and (n is None or n > 0):
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n = None if n is None else n - 1


class WarmPool:
    """Idle restored sandboxes per :data:`PoolKey`. ``restore`` and ``destroy`` come from the node."""

    def __init__(self, restore: RestoreFn, destroy: DestroyFn, *, default_size: int = 1,
                 sizes: Mapping[str, int] | None = None, metrics: PoolMetrics | None = None,
                 refill_delay: float = 0.0) -> None:
        if default_size < 0 or any(v < 0 for v in (sizes or {}).values()):
            raise ValueError("pool sizes must be >= 0")
        self._restore = restore
        self._destroy = destroy
        self.refill_delay = refill_delay
        """A refill waits this long after the last take: a restore and its warm-up (CPU-bound under TCG)
        started at once ran beside the first commands of the sandbox just handed out (its first `true`
        84 ms against 58 ms for its tenth, on 2 cores)."""
        self.default_size = default_size
        self.sizes = dict(sizes or {})
        self.metrics = metrics or PoolMetrics()
        self._slots: dict[PoolKey, _Slot] = {}
        self._restore_lock = asyncio.Lock()
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()

    def size_for(self, template: str) -> int:
        return self.sizes.get(template, self.default_size)

    def _labels(self, key: PoolKey) -> dict[str, str]:
        return {"template": key[0], "memory_mib": str(key[1]), "vcpus": str(key[2])}

    def _slot(self, key: PoolKey) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(key, self.size_for(key[0]))
            self.metrics.target.labels(**self._labels(key)).set(slot.target)
            self.metrics.idle.labels(**self._labels(key)).set(0)
        return slot

    def _gauge(self, slot: _Slot) -> None:
        self.metrics.idle.labels(**self._labels(slot.key)).set(len(slot.idle))

    # -- serving -----------------------------------------------------------------------------------------

    def watch(self, key: PoolKey) -> None:
        """Keep this template's pool filled from now on."""
        if self._closed:
            return
        slot = self._slot(key)
        if slot.target > 0 and (slot.task is None or slot.task.done()):
            slot.task = asyncio.create_task(self._refill(slot), name=f"pool-refill-{key[0]}")
        slot.wake.set()

    def take(self, key: PoolKey) -> Sandbox | None:
        """A pooled sandbox for ``key`` (counted as a hit), or None (a miss: the caller restores).

        The caller calls :meth:`watch` once it has bound the sandbox: a refill started right away would
        compete for the CPU with the request being served. Pooled sandboxes wait at the lowest CPU
        priority (restored with ``VMSpec.background``); the one handed out gets the normal priority back.
        """
        slot = self._slot(key)
        while slot.idle:
            sandbox = slot.idle.popleft()
            if sandbox.state is SandboxState.RUNNING:
                sandbox.set_background(False)
                slot.taken_at = time.monotonic()
                slot.hits += 1
                self.metrics.hits.labels(**self._labels(key)).inc()
                self._gauge(slot)
                return sandbox
            log.warning("pooled sandbox %s died while idle (%s); discarding it", sandbox.id, sandbox.failure)
            task = asyncio.create_task(self._destroy(sandbox))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        slot.misses += 1
        self.metrics.misses.labels(**self._labels(key)).inc()
        self._gauge(slot)
        return None

    async def take_soon(self, key: PoolKey) -> Sandbox | None:
        """:meth:`take`, but when none is idle while a refill's restore of ``key`` is running, first wait
        for that one: it started earlier than a restore on demand would, and two restores at once share
        the CPU (a fresh node's first create ran beside the pool's first fill: each took 0.5-0.7 s from
        QMP to a ready guest against about 0.2 s alone). A failed or cancelled refill wakes the waiters
        with nothing to take: they restore on demand."""
        slot = self._slot(key)
        if not slot.idle and slot.loading and not self._closed:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            slot.waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
                with contextlib.suppress(ValueError):
                    slot.waiters.remove(waiter)
        return self.take(key)

    async def _refill(self, slot: _Slot) -> None:
        attempt = 0
        while not self._closed:
            if len(slot.idle) + slot.restoring >= slot.target:
                slot.wake.clear()
                await slot.wake.wait()
                continue
            settle = slot.taken_at + self.refill_delay - time.monotonic()
            if settle > 0:
                await asyncio.sleep(settle)
                continue
            slot.restoring += 1
            try:
                async with self._restore_lock:
                    if self._closed:
                        return
                    slot.loading = True
                    try:
                        sandbox = await self._restore(slot.key)
                    finally:
                        slot.loading = False
            except asyncio.CancelledError:
                slot.wake_waiters()
                raise
            except Exception as exc:
                slot.wake_waiters()
                if getattr(exc, "code", None) == "template_not_found":
                    # Deleted (e.g. `capsa template rm` from another process): nothing left to refill.
                    log.info("template %s is gone; its warm pool stops refilling", slot.key[0])
                    return
                slot.failures += 1
                self.metrics.refill_failures.labels(**self._labels(slot.key)).inc()
                delay = _RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)]
                attempt += 1
                log.warning("warm pool refill of %s failed (%s); retrying in %.0fs", slot.key, exc, delay)
                await asyncio.sleep(delay)
                continue
            finally:
                slot.restoring -= 1
            attempt = 0
            if self._closed or slot.target <= len(slot.idle):
                slot.wake_waiters()
                await self._destroy(sandbox)
                continue
            slot.idle.append(sandbox)
            self._gauge(slot)
            slot.wake_waiters(1)

    # -- status and teardown ----------------------------------------------------------------------------

    def pooled(self) -> list[Sandbox]:
        return [sb for slot in self._slots.values() for sb in slot.idle]

    def status(self) -> list[dict[str, object]]:
        return [{"template": k[0], "memory_mib": k[1], "vcpus": k[2], "target": s.target, "idle": len(s.idle),
                 "restoring": s.restoring, "hits": s.hits, "misses": s.misses, "refill_failures": s.failures}
                for k, s in sorted(self._slots.items())]

    async def drain(self, template: str | None = None) -> None:
        """Stop filling and destroy the idle sandboxes of ``template`` (all templates when None)."""
        for key, slot in list(self._slots.items()):
            if template is not None and key[0] != template:
                continue
            if slot.task is not None:
                slot.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await slot.task
            while slot.idle:
                with contextlib.suppress(Exception):
                    await self._destroy(slot.idle.popleft())
            del self._slots[key]
            self.metrics.idle.labels(**self._labels(key)).set(0)

    async def close(self) -> None:
        self._closed = True
        for slot in self._slots.values():
            slot.wake_waiters()
        await self.drain()

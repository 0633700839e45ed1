"""Group commit of API-call audit events: one writer per replica gathers the events of every request that
finishes while a write is in flight and appends them all in the next transaction.

Concurrent requests share one transaction (one commit, one head lock per tenant) instead of queueing on
the database's write lock one by one. When a request's answer goes out depends on
``CAPSA_AUDIT_ACK`` (see :class:`~capsa.control.settings.ControlSettings`): ``durable`` waits until its
events are committed before the response's last byte; ``async`` (the default) hands them to the writer
and answers at once, so the audit trail is not a database write on the command's hot path. Then the
events are committed moments later (within ``CAPSA_AUDIT_LINGER_MS`` plus a transaction), in order,
calls made one after another sharing a transaction; reads of the trail through this replica first wait
for everything handed over before them (:meth:`AuditWriter.flush`), and a stopping replica writes what it
holds before it closes the database (:meth:`AuditWriter.aclose`). When the writer falls behind
(``max_pending`` requests waiting), requests wait for it again, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from capsa.control.audit import trail as audit_trail
from capsa.control.audit.trail import AuditEntry

__all__ = ["AuditWriter"]


@dataclass
class _Pending:
    tenant: str
    entries: Sequence[AuditEntry]
    done: asyncio.Future[None]


class AuditWriter:
    def __init__(self, engine: AsyncEngine, max_batch: int = 500, max_pending: int = 10_000,
                 linger: float = 0.0, thread_engine: Engine | None = None) -> None:
        self.engine = engine
        self.thread_engine = thread_engine
        """A synchronous engine on the same database (SQLite: ``store.db.sqlite_thread_engine``): each
        batch is then written by one thread of this writer's in one hand-off, not statement by
        statement through the async driver."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="capsa-audit") \
            if thread_engine is not None else None
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.linger = linger
        """Seconds a write waits for more events when nobody waits for the ones it has (``urgent``
        submits and :meth:`flush` cut it short): a client sending calls one after another then shares a
        transaction with its next few calls instead of paying one per call."""
        self._urgent = asyncio.Event()
        self._pending: list[_Pending] = []
        self._last: asyncio.Future[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.transactions = 0
        """Transactions written so far (for benchmarks and tests)."""

    def submit(self, tenant: str, entries: Sequence[AuditEntry], *, urgent: bool = True
               ) -> asyncio.Future[None]:
        """Queue ``entries`` for the tenant's chain; the future is done once they are committed (or holds
        the error). Queued events are written in the order they were submitted. ``urgent``: someone waits
        for the future, so the write does not linger."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(tenant, entries, done))
        self._last = done
        if urgent:
            self._urgent.set()
        if self._flusher is None or self._flusher.done():
            # An empty context: the flusher serves every request, it must not carry this one's audit context.
            self._flusher = asyncio.create_task(self._drain(), name="capsa-audit-writer",
                                                context=contextvars.Context())
        return done

    @property
    def behind(self) -> bool:
        """More requests wait for a write than ``max_pending``: callers should wait for theirs."""
        return len(self._pending) >= self.max_pending

    async def write(self, tenant: str, entries: Sequence[AuditEntry]) -> None:
        """Append ``entries`` to the tenant's chain; returns once they are committed (raises if not)."""
        await asyncio.shield(self.submit(tenant, entries))  # a cancelled request does not cancel the others'

    async def flush(self) -> None:
        """Wait until everything submitted so far is written (or failed: failures are the submitters')."""
        last = self._last
        if last is not None and not last.done():
            self._urgent.set()
            await asyncio.wait([last])

    async def _drain(self) -> None:
        while self._pending:
            if self.linger > 0 and not self._urgent.is_set() and len(self._pending) < self.max_batch:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.linger)
            self._urgent.clear()
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            by_tenant: dict[str, list[AuditEntry]] = {}
            for item in batch:
                by_tenant.setdefault(item.tenant, []).extend(item.entries)
            try:
                if self._thread is not None:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(self._thread, self._write_sync, by_tenant)
                else:
                    async with self.engine.begin() as conn:
                        for tenant in sorted(by_tenant):  # one lock order for every replica
                            await audit_trail.append(conn, tenant, by_tenant[tenant])
                self.transactions += 1
            except Exception as exc:
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)

    def _write_sync(self, by_tenant: dict[str, list[AuditEntry]]) -> None:
        assert self.thread_engine is not None
        with self.thread_engine.begin() as conn:
            for tenant in sorted(by_tenant):  # one lock order for every replica
                audit_trail.append_sync(conn, tenant, by_tenant[tenant])

    async def aclose(self) -> None:
        """Write what is still queued (the replica is stopping; its database is closed next)."""
        await self.flush()
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            assert self.thread_engine is not None
            self.thread_engine.dispose()

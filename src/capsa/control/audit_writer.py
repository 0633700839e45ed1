"""Group commit of API-call audit events: one writer per replica gathers the events of every request that
finishes while a write is in flight and appends them all in the next transaction.

Each request still waits until its own events are committed before its response's last byte goes out,
so nothing is acknowledged before it is durable; concurrent requests share one transaction (one commit,
one head lock per tenant) instead of queueing on the database's write lock one by one. A sequential
client sees one transaction per call, as without batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from capsa.control import audit_trail
from capsa.control.audit_trail import AuditEntry

__all__ = ["AuditWriter"]


@dataclass
class _Pending:
    tenant: str
    entries: Sequence[AuditEntry]
    done: asyncio.Future[None]


class AuditWriter:
    def __init__(self, engine: AsyncEngine, max_batch: int = 500) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self.transactions = 0
        """Transactions written so far (for benchmarks and tests)."""

    async def write(self, tenant: str, entries: Sequence[AuditEntry]) -> None:
        """Append ``entries`` to the tenant's chain; returns once they are committed (raises if not)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(tenant, entries, done))
        if self._flusher is None or self._flusher.done():
            # An empty context: the flusher serves every request, it must not carry this one's audit context.
            self._flusher = asyncio.create_task(self._drain(), name="capsa-audit-writer",
                                                context=contextvars.Context())
        await asyncio.shield(done)  # a cancelled request does not cancel the others' write

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            by_tenant: dict[str, list[AuditEntry]] = {}
            for item in batch:
                by_tenant.setdefault(item.tenant, []).extend(item.entries)
            try:
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

    async def aclose(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher

"""When an API call's answer goes out relative to its audit events (``CAPSA_AUDIT_ACK``): ``async`` answers
while the audit chain cannot be written (another connection holds the tenant's head), reads of the trail
wait for the events and then find them, and a stopping replica writes what it holds before it closes;
``durable`` holds the answer until its events are committed. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import create_async_engine

from capsa.control.store.audit_models import AuditHeadRow, AuditTrailRow
from tests.support.api_stack import ApiStack

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgresql]

Factory = Callable[..., Awaitable[ApiStack]]


@asynccontextmanager
async def head_locked(db_url: str, tenant: str) -> AsyncIterator[None]:
    """Another connection holds the tenant's audit head (a write transaction on it) until the block ends:
    no replica can append to that chain meanwhile."""
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            await conn.begin()
            done = await conn.execute(update(AuditHeadRow).where(AuditHeadRow.tenant == tenant)
                                      .values(seq=AuditHeadRow.seq))
            assert done.rowcount == 1
            try:
                yield
            finally:
                await conn.rollback()
    finally:
        await engine.dispose()


async def _request_ids(db_url: str, tenant: str) -> set[str]:
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(select(AuditTrailRow.request_id).where(AuditTrailRow.tenant == tenant))
            return {r for (r,) in rows if r}
    finally:
        await engine.dispose()


async def _pending(task: asyncio.Task[Any], seconds: float = 0.6) -> bool:
    await asyncio.wait([task], timeout=seconds)
    return not task.done()


async def test_async_answers_first_and_reads_wait_for_the_events(make_stack: Factory, db_url: str) -> None:
    stack = await make_stack(settings={"audit_ack": "async", "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        assert (await c.get("/v1/sessions")).status_code == 200
        assert (await c.get("/v1/audit")).status_code == 200  # waits for that call: the chain has a head
        async with head_locked(db_url, "acme"):
            answered = await asyncio.wait_for(c.get("/v1/sessions"), 20)
            assert answered.status_code == 200
            call = answered.headers["x-request-id"]
            reading = asyncio.create_task(c.get("/v1/audit", params={"kind": "api", "limit": 200}))
            assert await _pending(reading), "the trail was read before this replica's events were written"
        page = await asyncio.wait_for(reading, 30)
        assert page.status_code == 200
        assert call in {e["request_id"] for e in page.json()["items"]}
        verified = await c.get("/v1/audit/verify")
        assert verified.status_code == 200 and verified.json()["ok"], verified.text


async def test_durable_holds_the_answer_until_its_events_are_committed(make_stack: Factory,
                                                                       db_url: str) -> None:
    stack = await make_stack(settings={"audit_ack": "durable", "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        assert (await c.get("/v1/sessions")).status_code == 200
        async with head_locked(db_url, "acme"):
            call = asyncio.create_task(c.get("/v1/sessions"))
            assert await _pending(call), "a durable answer went out before its events were committed"
        answered = await asyncio.wait_for(call, 30)
        assert answered.status_code == 200
        assert answered.headers["x-request-id"] in await _request_ids(db_url, "acme")


async def test_a_stopping_replica_writes_the_events_it_holds(make_stack: Factory, db_url: str) -> None:
    stack = await make_stack(settings={"audit_ack": "async", "reaper_interval": 0})
    other = await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key, url=other.url) as c:
        assert (await c.get("/v1/sessions")).status_code == 200
        assert (await c.get("/v1/audit")).status_code == 200
        async with head_locked(db_url, "acme"):
            answered = await asyncio.wait_for(c.get("/v1/sessions"), 20)
            assert answered.status_code == 200
            stopping = asyncio.create_task(other.stop())
            assert await _pending(stopping), "the replica stopped without writing what it held"
            assert answered.headers["x-request-id"] not in await _request_ids(db_url, "acme")
        await asyncio.wait_for(stopping, 30)
    stack.replicas.remove(other)
    assert answered.headers["x-request-id"] in await _request_ids(db_url, "acme")


async def test_calls_one_after_another_share_transactions_within_the_linger(make_stack: Factory,
                                                                             db_url: str) -> None:
    stack = await make_stack(settings={"audit_ack": "async", "audit_linger_ms": 1000, "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    writer = stack.replicas[0].app.state.plane.audit
    async with stack.client(key) as c:
        assert (await c.get("/v1/audit")).status_code == 200
        # That read's own event was handed over with its answer: written now, so that no linger begun
        # before the one below can end while the calls are made (a 1 s one did, on a loaded host).
        await writer.flush()
        writer.linger = 60.0  # longer than the test: only a read of the trail may end it
        before = writer.transactions
        calls = [(await c.get("/v1/sessions")).headers["x-request-id"] for _ in range(6)]
        await asyncio.sleep(0.3)
        assert not set(calls) & await _request_ids(db_url, "acme")  # answered, held by the lingering writer
        # A read of the trail cuts the linger short and finds them all, written in one transaction.
        page = await asyncio.wait_for(c.get("/v1/audit", params={"kind": "api", "limit": 200}), 10)
        assert set(calls) <= {e["request_id"] for e in page.json()["items"]}
        assert writer.transactions - before == 1, writer.transactions - before
        writer.linger = 0.0


async def test_without_a_linger_each_call_is_written_at_once(make_stack: Factory, db_url: str) -> None:
    stack = await make_stack(settings={"audit_ack": "async", "audit_linger_ms": 0, "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    writer = stack.replicas[0].app.state.plane.audit
    async with stack.client(key) as c:
        assert (await c.get("/v1/audit")).status_code == 200
        await asyncio.sleep(0.2)  # that read's own event is written after its answer
        before = writer.transactions
        for _ in range(4):
            assert (await c.get("/v1/sessions")).status_code == 200
            await asyncio.sleep(0.1)
        assert writer.transactions - before == 4, writer.transactions - before

"""Appending to the tenant audit chain from several engines at once (replicas) and concurrent tasks keeps
one unbroken chain per tenant, on SQLite and PostgreSQL; verify names the first altered or missing event."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import event, text

from capsa.control.audit import trail as audit_trail
from capsa.control.audit.trail import AuditEntry
from capsa.control.store.db import create_engine, migrate, session_factory, sqlite_thread_engine
from tests.support.control_db import database_url
from tests.support.postgres import PgCluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.postgresql]


async def test_concurrent_replicas_append_one_chain_per_tenant(db_url: str) -> None:
    engines = [create_engine(db_url) for _ in range(3)]
    try:
        await migrate(engines[0])
        factories = [session_factory(e) for e in engines]

        async def writer(n: int) -> None:
            db = engines[n % len(engines)]
            for i in range(10):
                tenant = "acme" if (n + i) % 3 else "other"
                await audit_trail.write(db, tenant, [AuditEntry("api", "call", detail={"w": n, "i": i}),
                                                     AuditEntry("command", "run", detail={"w": n})])

        await asyncio.gather(*(writer(n) for n in range(8)))
        async with factories[0]() as db:
            for tenant in ("acme", "other"):
                result = await audit_trail.verify(db, tenant)
                assert result.broken is None, result
            acme = await audit_trail.verify(db, "acme")
            other = await audit_trail.verify(db, "other")
            assert acme.head + other.head == 8 * 10 * 2
            events = await audit_trail.list_events(db, "acme", limit=1000)
            assert [e.seq for e in events] == list(range(1, acme.head + 1))
            assert {e.tenant for e in events} == {"acme"}
            assert len(await audit_trail.list_events(db, "acme", kinds=["command"], limit=1000)) \
                == acme.head // 2

        async with engines[1].begin() as conn:
            await conn.execute(text("UPDATE audit_trail SET action = 'forged' WHERE tenant = 'acme' "
                                    "AND seq = 7"))
        async with factories[2]() as db:
            broken = await audit_trail.verify(db, "acme")
        assert broken.broken is not None and broken.broken.id == 7
        assert broken.checked == 6
    finally:
        for engine in engines:
            await engine.dispose()


async def test_record_inside_a_rolled_back_transaction_leaves_nothing(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        await migrate(engine)
        db = session_factory(engine)
        async with db() as session:
            assert await audit_trail.record(session, tenant="acme", kind="session", action="create") == 1
            await session.rollback()
        async with db() as session:
            assert await audit_trail.record(session, tenant="acme", kind="session", action="create") == 1
            await session.commit()
        async with db() as session:
            assert (await audit_trail.verify(session, "acme")).head == 1
    finally:
        await engine.dispose()


# The writer thread is SQLite's only (store.db.sqlite_thread_engine): asyncpg has no per-call thread hop to
# save, so PostgreSQL is written through its async driver alone.
@pytest.mark.parametrize(("kind", "thread"), [("sqlite", False), ("sqlite", True), ("postgresql", False)],
                         ids=["sqlite-async-driver", "sqlite-writer-thread", "postgresql-async-driver"])
async def test_group_commit_shares_transactions_between_concurrent_requests(
        kind: str, thread: bool, tmp_path: Path, pg_cluster: PgCluster | None) -> None:
    from capsa.control.audit.writer import AuditWriter

    engine = create_engine(database_url(kind, tmp_path, pg_cluster))
    thread_engine = sqlite_thread_engine(engine) if kind == "sqlite" and thread else None
    if kind == "postgresql":
        assert sqlite_thread_engine(engine) is None  # no writer thread on PostgreSQL
    try:
        await migrate(engine)
        writer = AuditWriter(engine, thread_engine=thread_engine)
        assert (writer.thread_engine is not None) == thread
        # Commits counted by the database layer, on every engine of this database, not by the writer itself.
        commits: list[str] = []

        def counter(name: str) -> Callable[[object], None]:
            return lambda _conn: commits.append(name)

        listeners = [(engine.sync_engine, counter("async"))]
        if thread_engine is not None:
            listeners.append((thread_engine, counter("thread")))
        for e, on_commit in listeners:
            event.listen(e, "commit", on_commit)
        await asyncio.gather(*(writer.write("acme" if i % 2 else "other",
                                            [AuditEntry("api", "call", request_id=f"req_{i}"),
                                             AuditEntry("command", "run", request_id=f"req_{i}")])
                               for i in range(40)))
        for e, on_commit in listeners:
            event.remove(e, "commit", on_commit)
        # 40 requests handed over together, 80 events for two tenants: the writer's first transaction takes
        # every one already queued (at most the first alone, then the 39 that queued meanwhile together),
        # on the engine it is meant to use.
        assert 1 <= len(commits) <= 2, commits
        assert set(commits) == {"thread" if thread else "async"}, commits
        assert writer.transactions == len(commits)
        async with session_factory(engine)() as db:
            for tenant in ("acme", "other"):
                result = await audit_trail.verify(db, tenant)
                assert result.broken is None and result.head == 40
                events = await audit_trail.list_events(db, tenant, limit=100)
                # A request's events stay together and in order.
                assert all(events[i].request_id == events[i + 1].request_id and events[i].kind == "api"
                           for i in range(0, 40, 2))
        await writer.aclose()
    finally:
        await engine.dispose()


async def test_writer_thread_and_async_replica_append_one_chain(tmp_path: Path) -> None:
    """A replica writing through its SQLite thread and one writing through aiosqlite, at once, on one
    file: the head lock serializes them and the chain stays whole."""
    from capsa.control.audit.writer import AuditWriter

    url = f"sqlite+aiosqlite:///{tmp_path}/capsa.db"
    engines = [create_engine(url), create_engine(url)]
    try:
        await migrate(engines[0])
        threaded = AuditWriter(engines[0], thread_engine=sqlite_thread_engine(engines[0]))
        assert threaded.thread_engine is not None
        plain = AuditWriter(engines[1])
        await asyncio.gather(*(w.write("acme", [AuditEntry("api", "call", request_id=f"req_{i}")])
                               for i in range(30) for w in (threaded, plain)))
        async with session_factory(engines[1])() as db:
            result = await audit_trail.verify(db, "acme")
        assert result.broken is None and result.head == 60
        await threaded.aclose()
        await plain.aclose()
        assert threaded.thread_engine.pool.checkedout() == 0
    finally:
        for engine in engines:
            await engine.dispose()


def test_no_writer_thread_for_memory_or_other_databases() -> None:
    assert sqlite_thread_engine(create_engine("sqlite+aiosqlite:///:memory:")) is None
    assert sqlite_thread_engine(create_engine("postgresql+asyncpg://u:p@127.0.0.1/db")) is None

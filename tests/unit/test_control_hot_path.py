"""The command hot path's database writes: rate limits claimed in leases per replica and activity stamps
written with bounded staleness (ARCHITECTURE.md, "Control plane"); the limits and the idle timeout still
hold. On SQLite and PostgreSQL, with the fake runtime."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select

from capsa.control import ratelimit
from capsa.control.errors import RateLimited
from capsa.control.plane import ControlPlane
from capsa.control.ratelimit import RateLimiter, lease_size
from capsa.control.store.models import RateCounterRow
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgresql]


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    session: dict[str, Any] = response.json()
    return session


def plane_of(stack: ApiStack, replica: int = 0) -> ControlPlane:
    plane: ControlPlane = stack.replicas[replica].app.state.plane
    return plane


@contextmanager
def statements(plane: ControlPlane, on_statement: Callable[[str], None]) -> Iterator[None]:
    """Calls ``on_statement`` with every statement the plane's engines run meanwhile (the audit writer's
    SQLite thread has an engine of its own)."""
    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        on_statement(statement)

    engines = [plane.engine.sync_engine]
    if plane.audit.thread_engine is not None:
        engines.append(plane.audit.thread_engine)
    for engine in engines:
        event.listen(engine, "before_cursor_execute", on_execute)
    try:
        yield
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", on_execute)


@contextmanager
def counting_writes(plane: ControlPlane, audit: list[str] | None = None) -> Iterator[list[str]]:
    """The data-changing statements the plane's engine runs meanwhile, except the audit chain's (every
    API call is recorded by design: docs/audit.md), which go to ``audit`` when given."""
    writes: list[str] = []

    def on_statement(statement: str) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper()
        if verb in ("INSERT", "UPDATE", "DELETE"):
            target = statement.split("SET")[0].strip()
            if " audit_trail" in target or " audit_heads" in target:
                if audit is not None:
                    audit.append(target)
                return
            writes.append(target)

    with statements(plane, on_statement):
        yield writes


async def run_true(client: httpx.AsyncClient, sid: str) -> httpx.Response:
    return await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})


@pytest.mark.usefixtures("pinned_rate_window")
async def test_commands_do_not_write_the_database_each(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"rate_lease": 16, "command_limit": 600,
                                                 "rate_window_seconds": 3600, "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    plane = plane_of(stack)
    async with stack.client(key) as c:
        sid = (await create(c))["id"]
        claims = plane.rates.claims
        await plane.audit.flush()  # the create's events
        audit: list[str] = []
        with counting_writes(plane, audit) as writes:
            for _ in range(32):
                assert (await run_true(c, sid)).status_code == 200
            await plane.audit.flush()  # answers go out before their audit events are committed
        # 32 commands: two leases of 16 from the rate counter (the first: an UPDATE finding no row for
        # this window, then its INSERT), no activity stamp (the session is new).
        assert len(writes) <= 3, writes
        # The audit chain: at most one transaction per call (head upsert, the api + command events, head
        # update), fewer when calls finish while a write is in flight (group commit).
        assert 0 < len(audit) <= 3 * 32 and len(audit) % 3 == 0, audit
        assert all("rate_counters" in w for w in writes), writes
        assert plane.rates.claims - claims == 2
        # The same commands with leases of one and a stamp on every call: the counter above can see writes.
        stamping: ApiStack = await make_stack(settings={"rate_lease": 1, "activity_stamp_interval": 0,
                                                        "reaper_interval": 0})
        key2 = await stamping.tenant_key("acme")
        async with stamping.client(key2) as c2:
            sid2 = (await create(c2))["id"]
            with counting_writes(plane_of(stamping)) as every:
                for _ in range(4):
                    assert (await run_true(c2, sid2)).status_code == 200
            assert len(every) >= 8, every
            await c2.delete(f"/v1/sessions/{sid2}")
        await c.delete(f"/v1/sessions/{sid}")


@pytest.mark.usefixtures("pinned_rate_window")
async def test_rate_limit_holds_across_replicas_within_the_lease_bound(make_stack: Any) -> None:
    limit = 100
    stack: ApiStack = await make_stack(settings={"command_limit": limit, "rate_window_seconds": 3600,
                                                 "rate_lease": 16, "reaper_interval": 0})
    lease = lease_size(limit, 16)
    assert lease == 5
    b, c_ = await stack.add_replica(), await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a, stack.client(key, url=b.url) as rb, \
            stack.client(key, url=c_.url) as rc:
        sid = (await create(a))["id"]
        # Replicas b and c each claim a lease and spend one unit of it...
        for client in (rb, rc):
            assert (await run_true(client, sid)).status_code == 200
        # ...so a alone is refused early, by at most what they hold unspent.
        ok_a = 0
        while (response := await run_true(a, sid)).status_code == 200:
            ok_a += 1
        assert_problem(response, 429, "rate_limited")
        assert int(response.headers["retry-after"]) >= 1
        assert ok_a >= limit - 2 - 2 * (lease - 1)
        # What b and c hold is still theirs; then every replica refuses, having admitted exactly the limit.
        ok_rest = 0
        for client in (rb, rc):
            while (response := await run_true(client, sid)).status_code == 200:
                ok_rest += 1
            assert_problem(response, 429, "rate_limited")
        assert 2 + ok_a + ok_rest == limit
        for client in (a, rb, rc):
            assert_problem(await run_true(client, sid), 429, "rate_limited")
        await a.delete(f"/v1/sessions/{sid}")


@pytest.mark.usefixtures("pinned_rate_window")
async def test_concurrent_leases_never_admit_beyond_the_limit(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"reaper_interval": 0})
    plane = plane_of(stack)
    replicas = [RateLimiter(lease=4) for _ in range(3)]
    limit = 80  # lease_size: 4

    async def one(i: int) -> bool:
        try:
            await replicas[i % 3].hit(plane.db, "key_x", "commands", limit, 3600)
        except RateLimited:
            return False
        return True

    admitted = sum(await asyncio.gather(*(one(i) for i in range(200))))
    assert limit - 2 * 3 <= admitted <= limit
    async with plane.db() as db:
        count = (await db.execute(select(RateCounterRow.count).where(RateCounterRow.key_id == "key_x"))
                 ).scalar_one()
    assert count >= admitted
    # Far fewer claims (database writes) than admitted requests.
    assert sum(r.claims for r in replicas) <= admitted // 4 + 2 * 3


async def test_leases_lapse_with_their_window(make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stack: ApiStack = await make_stack(settings={"reaper_interval": 0})
    plane = plane_of(stack)
    limiter = RateLimiter(lease=16)
    window = 2
    # The limiter's clock, moved by hand: the calls land in the window the test means, however slow the host.
    clock = [1_000_000.1]
    monkeypatch.setattr(ratelimit, "time", SimpleNamespace(time=lambda: clock[0]))
    for _ in range(3):
        await limiter.hit(plane.db, "key_w", "sessions", 3, window)
    clock[0] += 0.5
    with pytest.raises(RateLimited) as refused:
        await limiter.hit(plane.db, "key_w", "sessions", 3, window)
    assert int(refused.value.headers["Retry-After"]) == 2  # 1.4 s left, rounded up
    claims = limiter.claims
    with pytest.raises(RateLimited):  # known full: refused without another claim
        await limiter.hit(plane.db, "key_w", "sessions", 3, window)
    assert limiter.claims == claims
    clock[0] += window
    await limiter.hit(plane.db, "key_w", "sessions", 3, window)  # a new window, a new budget
    with pytest.raises(RateLimited):  # a branch costing more than the window can hold
        await limiter.hit(plane.db, "key_w", "sessions", 3, window, cost=3)


async def test_idle_timeout_with_activity_stamps_written_sparingly(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"activity_stamp_interval": 3600, "reaper_interval": 0.1})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        busy = await create(c, timeout=600, idle_timeout=2)
        idle = await create(c, timeout=600, idle_timeout=2)
        started = time.monotonic()
        stamps: set[str] = set()
        # Busy: a command every 0.3 s for 4 s (twice its idle timeout). Its stamp is written at most every
        # idle/4 = 0.5 s, and the reaper allows for that, so it is never taken for idle.
        while time.monotonic() - started < 4.0:
            assert (await run_true(c, busy["id"])).status_code == 200
            stamps.add((await c.get(f"/v1/sessions/{busy['id']}")).json()["last_activity_at"])
            await asyncio.sleep(0.3)
        assert (await c.get(f"/v1/sessions/{busy['id']}")).json()["state"] == "running"
        assert 3 <= len(stamps) <= 10, stamps  # stamped, but not on each of the ~12 commands
        closed = (await c.get(f"/v1/sessions/{idle['id']}")).json()
        assert closed["state"] == "closed" and closed["failure_reason"] == "idle_timeout"
        # Not before its idle timeout, and within the timeout + the staleness + a few reaper passes.
        lived = (datetime.fromisoformat(closed["closed_at"])
                 - datetime.fromisoformat(closed["last_activity_at"])).total_seconds()
        assert 2.0 <= lived <= 2.0 + 0.5 + 1.0, lived
        # Once the busy one stops, it is closed as idle too.
        for _ in range(60):
            state = (await c.get(f"/v1/sessions/{busy['id']}")).json()
            if state["state"] == "closed":
                break
            await asyncio.sleep(0.1)
        assert state["state"] == "closed" and state["failure_reason"] == "idle_timeout"


@contextmanager
def counting_reads(plane: ControlPlane, table: str) -> Iterator[list[str]]:
    """The statements the plane's engine runs meanwhile that read ``table``."""
    reads: list[str] = []

    def on_statement(statement: str) -> None:
        if statement.lstrip().upper().startswith("SELECT") and f"FROM {table}" in statement:
            reads.append(statement)

    with statements(plane, on_statement):
        yield reads


_QUIET = {"reaper_interval": 0, "rolling_snapshot_interval": 0}
"""No reaper and no rolling-snapshot pass in stacks that count session reads: the pass's periodic query
reads the sessions table too, and once fell inside a counted window."""


class _Clock:
    """``time.monotonic`` for a module, moved forward by hand (a cache period passes without sleeping)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        self.offset = 0.0
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + self.offset))

    def advance(self, seconds: float) -> None:
        self.offset += seconds


async def test_api_keys_are_read_once_per_cache_period_and_revocation_bounds_hold(
        make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from capsa.control import ttl_cache

    clock = _Clock(monkeypatch, ttl_cache)  # the key cache's clock
    period = 60.0  # long enough that no real delay ends it: only the test's clock does
    stack: ApiStack = await make_stack(settings={"key_cache_seconds": period, "reaper_interval": 0})
    other = await stack.add_replica()
    key = await stack.tenant_key("acme")
    key_id = key.rsplit("_", 1)[0]
    plane = plane_of(stack)
    async with stack.client(key) as a, stack.client(key, url=other.url) as b, \
            stack.client(stack.admin_key) as admin:
        sid = (await create(a))["id"]
        assert (await run_true(b, sid)).status_code == 200  # b has read the key now
        with counting_reads(plane, "api_keys") as reads:
            for _ in range(8):
                assert (await run_true(a, sid)).status_code == 200
        assert reads == [], reads  # a read it for the create, within the period
        # Revoked through replica a: a refuses it at once...
        assert (await admin.delete(f"/v1/keys/{key_id}")).status_code == 200
        assert_problem(await run_true(a, sid), 401, "unauthorized")
        # ...b trusts what it read for the period (it does not read the key on every call), then refuses
        # it too: once the period has passed since b read it, whatever the host's pace.
        assert (await run_true(b, sid)).status_code == 200
        clock.advance(period)
        assert_problem(await run_true(b, sid), 401, "unauthorized")
        # A wrong secret for a cached key id is refused: the hash is checked on every call.
        forged = f"{stack.admin_key.rsplit('_', 1)[0]}_{'x' * 32}"
        async with stack.client(forged) as f:
            assert_problem(await f.get("/v1/sessions"), 401, "unauthorized")


async def test_without_the_key_cache_a_revoked_key_stops_on_every_replica_at_once(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"key_cache_seconds": 0, "reaper_interval": 0})
    other = await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a, stack.client(key, url=other.url) as b, \
            stack.client(stack.admin_key) as admin:
        assert (await b.get("/v1/sessions")).status_code == 200
        assert (await admin.delete(f"/v1/keys/{key.rsplit('_', 1)[0]}")).status_code == 200
        assert_problem(await b.get("/v1/sessions"), 401, "unauthorized")
        assert_problem(await a.get("/v1/sessions"), 401, "unauthorized")


async def test_commands_read_their_session_once_per_cache_period(make_stack: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from capsa.control import ttl_cache

    clock = _Clock(monkeypatch, ttl_cache)  # the session cache's clock
    period = 60.0  # long enough that no real delay ends it: only the test's clock does
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": period, **_QUIET})
    key, other_key = await stack.tenant_key("acme"), await stack.tenant_key("globex")
    plane = plane_of(stack)
    async with stack.client(key) as c, stack.client(other_key) as intruder:
        sid = (await create(c))["id"]
        assert (await run_true(c, sid)).status_code == 200
        with counting_reads(plane, "sessions") as reads:
            for _ in range(6):
                assert (await run_true(c, sid)).status_code == 200
            assert (await c.get(f"/v1/sessions/{sid}/files/list", params={"path": "/"})).status_code == 200
        assert reads == [], reads
        # The cached row belongs to its tenant only: another tenant still sees no such session.
        assert_problem(await run_true(intruder, sid), 404, "not_found")
        # After the period the row is read again.
        clock.advance(period)
        with counting_reads(plane, "sessions") as reads:
            assert (await run_true(c, sid)).status_code == 200
        assert len(reads) == 1, reads


async def test_a_session_closed_or_paused_elsewhere_answers_with_its_state(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": 60, **_QUIET})
    other = await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a, stack.client(key, url=other.url) as b:
        closing, pausing = (await create(a))["id"], (await create(a))["id"]
        for sid in (closing, pausing):
            assert (await run_true(a, sid)).status_code == 200  # cached on replica a now
        assert (await b.delete(f"/v1/sessions/{closing}")).status_code == 200
        assert (await b.post(f"/v1/sessions/{pausing}/pause")).status_code == 200
        # Replica a still holds both as running: its call reaches the node, which no longer has the
        # sandboxes; a reads the rows again and answers with their states, leaving them as they are.
        assert_problem(await run_true(a, closing), 409, "invalid_state")
        assert_problem(await run_true(a, pausing), 409, "invalid_state")
        assert (await a.get(f"/v1/sessions/{closing}")).json()["state"] == "closed"
        paused = (await a.get(f"/v1/sessions/{pausing}")).json()
        assert paused["state"] == "paused" and "lost" not in (paused.get("pause_reason") or ""), paused
        # Resumed through b (a new sandbox): a's next call finds it after one refusal at most.
        assert (await b.post(f"/v1/sessions/{pausing}/resume")).status_code == 200
        answers = [(await run_true(a, pausing)).status_code for _ in range(2)]
        assert answers[-1] == 200, answers
        assert (await a.get(f"/v1/sessions/{pausing}")).json()["state"] == "running"


async def test_a_session_closed_through_this_replica_is_refused_without_a_node_call(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": 60, **_QUIET})
    key = await stack.tenant_key("acme")
    plane = plane_of(stack)
    async with stack.client(key) as c:
        sid = (await create(c))["id"]
        assert (await run_true(c, sid)).status_code == 200
        assert plane.sessions.lookup(sid) is not None
        assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 200
        assert plane.sessions.lookup(sid) is None
        assert_problem(await run_true(c, sid), 409, "invalid_state")


async def test_sessions_with_rolling_snapshots_are_never_cached(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": 60, "reaper_interval": 0})
    key = await stack.tenant_key("acme")
    plane = plane_of(stack)
    async with stack.client(key) as c:
        sid = (await create(c, rolling_snapshots={"keep": 2, "interval_s": 60}))["id"]
        with counting_reads(plane, "sessions") as reads:
            for _ in range(3):
                assert (await run_true(c, sid)).status_code == 200
        assert plane.sessions.lookup(sid) is None
        assert len(reads) >= 3, reads


async def test_a_new_sessions_first_command_reads_no_session_row(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": 60, **_QUIET})
    key = await stack.tenant_key("acme")
    plane = plane_of(stack)
    async with stack.client(key) as c:
        sid = (await create(c, idle_timeout=600))["id"]
        with counting_reads(plane, "sessions") as reads:
            assert (await run_true(c, sid)).status_code == 200
        assert reads == [], reads


async def test_a_resume_through_the_replica_that_holds_the_entry_forgets_it(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"session_cache_seconds": 60, **_QUIET})
    other = await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a, stack.client(key, url=other.url) as b:
        sid = (await create(a))["id"]
        assert (await run_true(b, sid)).status_code == 200  # b holds it
        assert (await a.post(f"/v1/sessions/{sid}/pause")).status_code == 200
        assert (await b.post(f"/v1/sessions/{sid}/resume")).status_code == 200
        assert (await run_true(b, sid)).status_code == 200  # at once: b read the resumed row


async def test_the_control_service_reads_the_row_on_every_call_by_default(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"reaper_interval": 0})
    key = await stack.tenant_key("acme")
    plane = plane_of(stack)
    async with stack.client(key) as c:
        sid = (await create(c))["id"]
        with counting_reads(plane, "sessions") as reads:
            for _ in range(3):
                assert (await run_true(c, sid)).status_code == 200
        assert len(reads) >= 3, reads

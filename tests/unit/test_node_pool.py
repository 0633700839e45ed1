"""The warm pool's bookkeeping with in-process sandboxes.

The same behaviour with real VMs: tests/integration/test_node_snapshots_vm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from prometheus_client import generate_latest

from capsa.node.guestlink.identity import bind_identity
from capsa.node.runtime.base import SandboxState
from capsa.node.templates.warm_pool import PoolKey, WarmPool
from tests.support.waits import eventually

KEY: PoolKey = ("base", 256, 1)


class _Sandbox:
    def __init__(self, n: int) -> None:
        self.id = f"sbx_{n:020d}"
        self.state = SandboxState.RUNNING
        self.failure: str | None = None
        self.background = True  # as restored for the pool

    def set_background(self, background: bool) -> None:
        self.background = background


class _Fleet:
    """restore/destroy for the pool, recording what happened."""

    def __init__(self, fail: Callable[[int], bool] = lambda _n: False) -> None:
        self.made: list[_Sandbox] = []
        self.destroyed: list[str] = []
        self.fail = fail

    async def restore(self, key: PoolKey) -> _Sandbox:
        await asyncio.sleep(0.01)
        n = len(self.made)
        if self.fail(n):
            self.made.append(_Sandbox(n))
            raise RuntimeError("restore failed")
        sb = _Sandbox(n)
        self.made.append(sb)
        return sb

    async def destroy(self, sb: object) -> None:
        assert isinstance(sb, _Sandbox)
        sb.state = SandboxState.DESTROYED
        self.destroyed.append(sb.id)


async def _settle(pool: WarmPool, idle: int) -> None:
    for _ in range(500):
        status = pool.status()
        if status and status[0]["idle"] == idle and status[0]["restoring"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pool did not settle at {idle}: {pool.status()}")


async def test_hits_misses_refill_and_no_reuse() -> None:
    fleet = _Fleet()
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=2)  # type: ignore[arg-type]
    pool.watch(KEY)
    await _settle(pool, 2)
    handed = [pool.take(KEY), pool.take(KEY), pool.take(KEY)]
    assert handed[0] is not None and handed[1] is not None and handed[2] is None
    # Handed out at the normal CPU priority; those still waiting stay in the background.
    assert [sb.background for sb in handed if sb is not None] == [False, False]
    pool.watch(KEY)  # what the node does once the request is served
    await _settle(pool, 2)
    # Refilled with new sandboxes: nothing handed out ever comes back.
    assert {sb.id for sb in pool.pooled()}.isdisjoint({sb.id for sb in handed if sb is not None})
    status = pool.status()[0]
    assert (status["hits"], status["misses"], status["target"]) == (2, 1, 2)
    text = generate_latest(pool.metrics.registry).decode()
    assert 'capsa_pool_hits_total{memory_mib="256",template="base",vcpus="1"} 2.0' in text
    assert 'capsa_pool_misses_total{memory_mib="256",template="base",vcpus="1"} 1.0' in text
    assert 'capsa_pool_idle{memory_mib="256",template="base",vcpus="1"} 2.0' in text
    await pool.close()
    assert len(fleet.destroyed) == 2 and pool.pooled() == []


async def test_dead_idle_sandbox_is_discarded_not_handed_out() -> None:
    fleet = _Fleet()
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=1)  # type: ignore[arg-type]
    pool.watch(KEY)
    await _settle(pool, 1)
    dead = pool.pooled()[0]
    dead.state = SandboxState.FAILED  # type: ignore[misc]
    assert pool.take(KEY) is None
    pool.watch(KEY)
    await _settle(pool, 1)
    assert dead.id in fleet.destroyed
    await pool.close()


async def test_refill_failures_are_counted_and_retried() -> None:
    fleet = _Fleet(fail=lambda n: n == 0)
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=1)  # type: ignore[arg-type]
    pool.watch(KEY)
    await _settle(pool, 1)  # the first restore failed, the retry (after 1 s) worked
    assert pool.status()[0]["refill_failures"] == 1
    await pool.close()


async def test_size_zero_and_per_template_sizes() -> None:
    fleet = _Fleet()
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=0, sizes={"py": 1})  # type: ignore[arg-type]
    pool.watch(KEY)
    pool.watch(("py", 512, 1))
    for _ in range(100):
        if any(s["idle"] for s in pool.status()):
            break
        await asyncio.sleep(0.01)
    by_name = {s["template"]: s for s in pool.status()}
    assert by_name["base"]["idle"] == 0 and by_name["py"]["idle"] == 1
    assert pool.take(KEY) is None
    await pool.drain("py")
    assert [s["template"] for s in pool.status()] == ["base"]
    await pool.close()
    assert len(fleet.made) == 1 and fleet.destroyed == [fleet.made[0].id]


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="pool sizes"):
        WarmPool(_Fleet().restore, _Fleet().destroy, default_size=-1)  # type: ignore[arg-type]


async def test_bind_identity_reseeds_sets_clock_and_names() -> None:
    calls: list[tuple[str, object]] = []

    class Guest:
        async def reseed(self, entropy: bytes | None = None) -> None:
            calls.append(("reseed", entropy))

        async def set_clock(self, unix_ns: int | None = None) -> None:
            calls.append(("clock", unix_ns))

        async def set_hostname(self, name: str) -> None:
            calls.append(("hostname", name))

    await bind_identity(Guest(), hostname="sbx-1")
    await bind_identity(Guest(), hostname=None)
    assert [c[0] for c in calls] == ["reseed", "clock", "hostname", "reseed", "clock"]
    first, second = calls[0][1], calls[3][1]
    assert isinstance(first, bytes) and len(first) == 64 and first != second


async def test_refill_stops_when_the_template_is_gone() -> None:
    from capsa.common.errors import CapsaError

    calls = 0

    async def restore(key: PoolKey) -> _Sandbox:
        nonlocal calls
        calls += 1
        raise CapsaError("gone", code="template_not_found", status=404)

    pool = WarmPool(restore, _Fleet().destroy, default_size=1)  # type: ignore[arg-type]
    pool.watch(KEY)
    refill = pool._slots[KEY].task
    assert refill is not None
    # The refill ends by itself (bounded wait; a retry would come after 1 s and keep it running), after
    # one restore, not counted as a failure.
    await asyncio.wait_for(refill, 5)
    assert calls == 1 and pool.status()[0]["refill_failures"] == 0
    await pool.close()


async def test_a_refill_waits_for_the_delay_after_the_last_take() -> None:
    # The sandbox just handed out runs its first commands without a restore beside it.
    restored_at: list[float] = []
    fleet = _Fleet()

    async def restore(key: PoolKey) -> _Sandbox:
        restored_at.append(asyncio.get_running_loop().time())
        return await fleet.restore(key)

    pool = WarmPool(restore, fleet.destroy, default_size=1, refill_delay=0.3)  # type: ignore[arg-type]
    pool.watch(KEY)
    await _settle(pool, 1)  # the first fill does not wait: nothing was taken yet
    first = pool.take(KEY)
    taken = asyncio.get_running_loop().time()
    assert first is not None
    pool.watch(KEY)
    await asyncio.sleep(0.1)  # a third of the delay passes: nothing may happen meanwhile
    assert len(restored_at) == 1 and pool.status()[0]["idle"] == 0  # still waiting
    await _settle(pool, 1)
    assert restored_at[1] - taken >= 0.25  # (taken is read just after the pool stamped the take)
    await pool.close()


class _GatedFleet(_Fleet):
    """Restores that wait for ``gate``: a refill caught while its restore runs."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(lambda _n: fail)
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def restore(self, key: PoolKey) -> _Sandbox:
        self.started.set()
        await self.gate.wait()
        return await super().restore(key)


async def test_take_soon_waits_for_the_running_refill_instead_of_a_second_restore() -> None:
    fleet = _GatedFleet()
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=1)  # type: ignore[arg-type]
    pool.watch(KEY)
    await asyncio.wait_for(fleet.started.wait(), 5)
    assert pool.take(KEY) is None  # take alone does not wait: a miss
    taker = asyncio.create_task(pool.take_soon(KEY))
    await eventually(lambda: len(pool._slots[KEY].waiters) == 1, "take_soon waiting", within=5)
    assert not taker.done()  # waiting for the restore in flight
    fleet.gate.set()
    got = await asyncio.wait_for(taker, 5)
    # The refill's sandbox, handed out at normal priority.
    assert isinstance(got, _Sandbox) and got is fleet.made[0] and not got.background
    assert pool.status()[0]["hits"] == 1
    await pool.close()


async def test_take_soon_returns_nothing_when_the_refill_fails_or_none_runs() -> None:
    fleet = _GatedFleet(fail=True)
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=1)  # type: ignore[arg-type]
    assert await pool.take_soon(KEY) is None  # nothing restoring: no wait at all
    pool.watch(KEY)
    await asyncio.wait_for(fleet.started.wait(), 5)
    takers = [asyncio.create_task(pool.take_soon(KEY)) for _ in range(2)]
    await eventually(lambda: len(pool._slots[KEY].waiters) == 2, "both take_soon waiting", within=5)
    assert not any(t.done() for t in takers)
    fleet.gate.set()
    assert await asyncio.wait_for(asyncio.gather(*takers), 5) == [None, None]  # both restore on demand
    await pool.close()


async def test_a_cancelled_take_soon_leaves_no_waiter_and_close_wakes_the_rest() -> None:
    fleet = _GatedFleet()
    pool = WarmPool(fleet.restore, fleet.destroy, default_size=1)  # type: ignore[arg-type]
    pool.watch(KEY)
    await asyncio.wait_for(fleet.started.wait(), 5)
    gone = asyncio.create_task(pool.take_soon(KEY))
    await eventually(lambda: len(pool._slots[KEY].waiters) == 1, "take_soon waiting", within=5)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert not pool._slots[KEY].waiters
    stays = asyncio.create_task(pool.take_soon(KEY))
    await eventually(lambda: len(pool._slots[KEY].waiters) == 1, "take_soon waiting", within=5)
    await asyncio.wait_for(pool.close(), 5)  # the refill is cancelled mid-restore: the waiter wakes
    assert await asyncio.wait_for(stays, 5) is None
    assert fleet.made == []

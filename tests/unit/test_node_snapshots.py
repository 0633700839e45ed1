"""Snapshots, pause/restore, branch, templates and the warm pool through the production NodeAgent.

The runtime is the fake one (guest daemons as confined host processes, tests/support/fake_runtime.py),
which snapshots a guest's files; the agent, its sources, its snapshots part, the template store and the
warm pool are the product's. The same paths with real VMs: tests/integration/test_node_snapshots_vm.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.snapshots import Snapshots
from capsa.node.runtime.base import RamMode
from capsa.node.templates.source import ColdBootSource, TemplateSource
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="the fake runtime snapshots confined guests only (root)"),
]


async def _sh(agent: NodeAgent, sid: str, cmd: str) -> str:
    result = await agent.guest(sid).exec(cmd)
    assert result.exit_code == 0, result.stderr
    return result.stdout.decode()


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = ColdBootSource(runtime, {"base": image})
    a = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 32, 16),
                  snapshots=Snapshots(runtime, source.image_for, bind=runtime.bind_identity))
    await a.start()
    try:
        yield a
    finally:
        await a.close()


async def test_pause_restore_branch_and_cleanup(agent: NodeAgent) -> None:
    runtime = agent.runtime
    assert isinstance(runtime, FakeRuntime) and agent.snapshots is not None
    sid = new_id("sbx")
    await agent.create(sid, "base", 256, 1, {"A": "1"})
    await _sh(agent, sid, "echo kept > /tmp/state; mkdir -p /var/tmp/d && echo deep > /var/tmp/d/f")

    # Rolling-style snapshots while it runs (one kept, one not); it keeps running.
    rolling = await agent.snapshot(sid, retain=True, labels={"kind": "rolling"})
    assert rolling["sandbox_id"] == sid and rolling["retain"] is True
    assert rolling["labels"] == {"kind": "rolling"}
    assert await _sh(agent, sid, "cat /tmp/state") == "kept\n"
    await _sh(agent, sid, "echo later > /tmp/state")
    scratch = await agent.snapshot(sid)
    assert scratch["retain"] is False and scratch["parent"] == rolling["id"]

    # Pause: a retained snapshot, and the sandbox is gone with its snapshots that were not kept.
    paused = await agent.pause(sid)
    assert paused["retain"] is True and paused["parent"] == scratch["id"]
    assert agent.list() == [] and agent.used()["sandboxes"] == 0
    assert {i["id"] for i in agent.list_snapshots(sid)} == {rolling["id"], paused["id"]}

    # Resume: a new sandbox from the pause snapshot has the files as they were at the pause.
    resumed = new_id("sbx")
    record = await agent.restore(paused["id"], resumed, {"A": "2"})
    assert record.source == "restore" and record.snapshot == paused["id"] and record.create_ms is not None
    assert await _sh(agent, resumed, "cat /tmp/state /var/tmp/d/f; echo $A") == "later\ndeep\n2\n"
    assert runtime.hostnames[resumed] == resumed.replace("_", "-")

    # Rollback to the rolling snapshot: the earlier content.
    rolled = new_id("sbx")
    await agent.restore(rolling["id"], rolled, {})
    assert await _sh(agent, rolled, "cat /tmp/state") == "kept\n"

    # Branch 3: each has the file; a write in one does not show in the others.
    base = await agent.snapshot(resumed, retain=True)
    ids = [new_id("sbx") for _ in range(3)]
    branches = await agent.branch(base["id"], ids, {})
    assert [r.id for r in branches] == ids and {r.source for r in branches} == {"restore"}
    await _sh(agent, ids[0], "echo mine > /tmp/only-0")
    for i, bid in enumerate(ids):
        assert await _sh(agent, bid, "cat /tmp/state") == "later\n"
        seen = await _sh(agent, bid, "ls /tmp")
        assert ("only-0" in seen) == (i == 0)

    # Destroying a sandbox drops its snapshots that are not retained, and keeps the retained ones.
    await agent.destroy(sid)  # already gone: nothing to do
    assert agent.get_snapshot(rolling["id"])["id"] == rolling["id"]
    rolled_snap = await agent.snapshot(rolled)
    await agent.destroy(rolled)
    with pytest.raises(CapsaError) as gone:
        agent.get_snapshot(rolled_snap["id"])
    assert gone.value.code == "snapshot_not_found"
    await agent.destroy(resumed)
    assert agent.get_snapshot(base["id"])["retain"] is True

    await agent.delete_snapshot(base["id"])
    assert base["id"] not in {i["id"] for i in agent.list_snapshots()}
    assert not (runtime.snapshots_dir / base["id"]).exists()


async def test_refused_snapshot_requests_change_nothing(agent: NodeAgent) -> None:
    sid = new_id("sbx")
    await agent.create(sid, "base", 256, 1, {})
    before = (agent.used(), agent.list_snapshots())
    for bad, code in ((lambda: agent.restore("snap_" + "a" * 20, new_id("sbx"), {}), "snapshot_not_found"),
                      (lambda: agent.restore("../../etc", new_id("sbx"), {}), "snapshot_not_found"),
                      (lambda: agent.snapshot(sid, labels={"capsa.sandbox": "x"}), "bad_request"),
                      (lambda: agent.pause(new_id("sbx")), "sandbox_not_found")):
        with pytest.raises(CapsaError) as refused:
            await bad()
        assert refused.value.code == code
    snap = await agent.snapshot(sid, retain=True)
    with pytest.raises(CapsaError) as taken:
        await agent.restore(snap["id"], sid, {})
    assert taken.value.code == "already_exists"
    with pytest.raises(CapsaError) as dup:
        await agent.branch(snap["id"], [sid + "x"[:0], sid], {})
    assert dup.value.code in ("already_exists", "bad_request")
    for count in (0, 65):
        with pytest.raises(CapsaError) as bad_count:
            await agent.branch(snap["id"], [new_id("sbx") for _ in range(count)], {})
        assert bad_count.value.code == "invalid_branch_count" and bad_count.value.status == 422
    # A branch that cannot fit the node's capacity makes none of them.
    with pytest.raises(CapsaError) as full:
        await agent.branch(snap["id"], [new_id("sbx") for _ in range(16)], {})
    assert full.value.code == "no_capacity"
    assert agent.used() == before[0] and [r.id for r in agent.list()] == [sid]
    await agent.delete_snapshot(snap["id"])
    assert agent.list_snapshots() == before[1]


async def test_a_node_without_snapshots_refuses_them(tmp_path: Path) -> None:
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), snapshots=None)
    await agent.start()
    try:
        sid = new_id("sbx")
        await agent.create(sid, "base", 256, 1, {})
        other = new_id("sbx")
        for call in (agent.snapshot(sid), agent.pause(sid), agent.restore("snap_" + "a" * 20, other, {})):
            with pytest.raises(CapsaError) as refused:
                await call
            assert refused.value.code == "snapshots_unavailable" and refused.value.status == 501
        with pytest.raises(CapsaError):
            agent.list_templates()
        assert (await agent.guest(sid).exec("echo up")).stdout == b"up\n"
    finally:
        await agent.close()


async def test_template_source_pool_bind_restore_on_demand_and_snapshots(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = TemplateSource(runtime, image, pool_size=1, bind=runtime.bind_identity)
    agent = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 32, 16))
    await agent.start()
    try:
        await agent.wait_ready()  # base built: one cold boot, snapshotted into the template store
        # browser, desktop: shipped templates, listed before they are built (on first use)
        assert runtime.boots == 1 and agent.templates == ["base", "browser", "desktop"]
        [base] = agent.list_templates()
        assert base["name"] == "base" and base["memory_mib"] == 256 and base["snapshot"]
        for _ in range(200):  # the pool fills in the background
            if agent.pool_status()[0]["idle"] == 1:
                break
            await asyncio.sleep(0.05)
        assert agent.pool_status()[0]["idle"] == 1

        first, second = new_id("sbx"), new_id("sbx")
        hit = await agent.create(first, "base", 256, 1, {})
        assert hit.source == "pool" and hit.snapshot == base["snapshot"]
        assert runtime.hostnames[hit.sandbox.id] == first.replace("_", "-")
        miss = await agent.create(second, "base", 256, 1, {})
        assert miss.source in ("pool", "restore")  # the refill may have been quicker than this create
        status = agent.pool_status()[0]
        # No cold boot for sessions.
        assert [status["hits"], status["misses"]] in ([2, 0], [1, 1]) and runtime.boots == 1

        # Snapshots work on restored sandboxes too; a session's files stay its own.
        await _sh(agent, first, "echo one > /tmp/f")
        assert (await agent.guest(second).exec("cat /tmp/f")).exit_code != 0
        paused = await agent.pause(first)
        again = new_id("sbx")
        record = await agent.restore(paused["id"], again, {})
        assert record.template == "base" and await _sh(agent, again, "cat /tmp/f") == "one\n"

        with pytest.raises(CapsaError) as missing:
            await agent.create(new_id("sbx"), "nope", 256, 1, {})
        assert missing.value.code == "template_not_found"
        with pytest.raises(CapsaError) as internal:
            await agent.create(new_id("sbx"), "base-net", 256, 1, {})
        assert internal.value.code == "template_not_found"
        with pytest.raises(CapsaError) as protected:
            await agent.delete_template("base")
        assert protected.value.code == "template_protected"
    finally:
        await agent.close()
    assert runtime.list() == []


@pytest.mark.parametrize(("sharing", "pooled", "on_demand"), [
    ("off", (RamMode.COPY, None), [(RamMode.COPY, None)] * 3),
    # Pooled sandboxes have no tenant yet: their own RAM; restores on demand share within their tenant.
    ("tenant", (RamMode.COPY, None), [(RamMode.PRIVATE, "tenant:acme"), (RamMode.PRIVATE, "tenant:zeta"),
                                      (RamMode.PRIVATE, "node:")]),
    ("all", (RamMode.PRIVATE, "public"), [(RamMode.PRIVATE, "public")] * 3),
])
async def test_template_sharing_decides_who_shares_a_templates_ram(
        tmp_path: Path, sharing: Literal["off", "tenant", "all"], pooled: tuple[RamMode, str | None],
        on_demand: list[tuple[RamMode, str | None]]) -> None:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = TemplateSource(runtime, image, pool_size=1, bind=runtime.bind_identity, sharing=sharing)
    agent = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 32, 16))
    await agent.start()
    try:
        await agent.wait_ready()
        for _ in range(200):  # the pool fills in the background
            if agent.pool_status()[0]["idle"] == 1:
                break
            await asyncio.sleep(0.05)
        assert runtime.ram_modes == [pooled]
        source.warm.sizes["base"] = 0  # from here on every sandbox is a restore on demand
        await source.warm.drain("base")
        made = [await agent.create(new_id("sbx"), "base", 256, 1, {}, tenant=tenant)
                for tenant in ("acme", "zeta", None)]
        assert [m.source for m in made] == ["restore"] * 3
        assert runtime.ram_modes[1:] == on_demand
    finally:
        await agent.close()
    assert runtime.list() == []


async def test_a_sessions_tenant_reaches_the_nodes_restore(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = TemplateSource(runtime, image, pool_size=0, bind=runtime.bind_identity, sharing="tenant")
    async with ApiStack(f"sqlite+aiosqlite:///{tmp_path}/capsa.db", runtime, image, source=source) as stack:
        await source.wait_ready()
        for tenant in ("acme", "zeta"):
            async with stack.client(await stack.tenant_key(tenant)) as api:
                created = await api.post("/v1/sessions", json={})
                assert created.status_code == 201, created.text
        assert runtime.ram_modes == [(RamMode.PRIVATE, "tenant:acme"), (RamMode.PRIVATE, "tenant:zeta")]

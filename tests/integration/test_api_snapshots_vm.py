"""Sessions that outlive sandboxes, through the public API with real microVMs (QEMU microvm, TCG here).

HTTP -> control plane -> node API (NodeAgent, TemplateSource; docs/node-snapshots.md) -> QemuRuntime -> guest.
One VM is cold-booted for the module (the node's base template); every sandbox after it is restored.
The control plane's rolling snapshot loop and reaper run for real (short intervals).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.control.keys import generate_key
from capsa.control.settings import ControlSettings
from capsa.frontends import build_app
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.api.app import create_node_app
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool
from capsa.node.templates.source import TemplateSource
from tests.support.api_stack import Replica, serve_app
from tests.support.counter import COUNTER_FILE, counter_past, counter_script, goes_on

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop btrfs pool, VM uids)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),
]

NODE_TOKEN = "n" * 32
NODE_ID = "node-snap"
COUNTER = counter_script()


class Stack:
    def __init__(self, agent: NodeAgent, node: Replica, control: Replica, admin: str,
                 state_dir: Path) -> None:
        self.agent, self.node, self.control, self.admin = agent, node, control, admin
        self.state_dir = state_dir
        self.key = ""

    async def tenant_key(self, tenant: str) -> str:
        async with self.client(self.admin) as c:
            made = await c.post("/keys", json={"tenant": tenant})
        assert made.status_code == 201, made.text
        return str(made.json()["key"])

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.control.url + "/v1", timeout=300,
                                 headers={"Authorization": f"Bearer {key or self.key}"})

    @property
    def pool_root(self) -> Path:
        assert isinstance(self.agent.runtime, QemuRuntime)
        return self.agent.runtime.templates_dir.parent

    def snapshot_dirs(self) -> set[str]:
        return {p.name for p in (self.pool_root / "snapshots").iterdir()}

    async def heartbeat(self) -> None:
        """What the node's heartbeat loop does (capsa serve runs one every few seconds)."""
        body = {"used": self.agent.used(), "failed_sandboxes": self.agent.failed_sandboxes(),
                "sandboxes": [r.id for r in self.agent.list()]}
        async with self.client(NODE_TOKEN) as c:
            answer = await c.post(f"/nodes/{NODE_ID}/heartbeat", json=body)
        assert answer.status_code == 200, answer.text
        for sandbox_id in answer.json()["destroy_sandboxes"]:
            await self.agent.destroy(sandbox_id)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(state_dir: Path, pool: StoragePool, guest_image: GuestImage) -> AsyncIterator[Stack]:
    runtime = QemuRuntime(Settings(state_dir=state_dir, cache_dir=Settings().cache_dir),
                          storage=PoolStorage(pool))
    # No warm pool: keeps one VM fewer on two shared cores; sessions restore from the template on demand.
    agent = NodeAgent(runtime, guest_image, node_id=NODE_ID, capacity=NodeCapacity(8192, 32, 16),
                      source=TemplateSource(runtime, guest_image, pool_size=0))
    await agent.start()
    node: Replica | None = None
    control: Replica | None = None
    try:
        await agent.wait_ready()
        app = create_node_app(agent, NODE_TOKEN)
        node = await serve_app(app, uds=str(state_dir / "node.sock"), lifespan="off")
        admin = generate_key().full
        settings = ControlSettings(database_url=f"sqlite+aiosqlite:///{state_dir}/capsa.db",
                                   bootstrap_key=admin, reaper_interval=0.3, rolling_snapshot_interval=0.3)
        control = await serve_app(build_app(settings))
        s = Stack(agent, node, control, admin, state_dir)
        async with s.client(admin) as c:
            registered = await c.post("/nodes", json={
                "id": NODE_ID, "url": node.url, "token": NODE_TOKEN,
                "capacity": {"memory_mib": 8192, "vcpus": 32, "max_sandboxes": 16},
                "templates": sorted(agent.templates)})
            assert registered.status_code in (200, 201), registered.text
        s.key = await s.tenant_key("acme")

        async def beat() -> None:
            # As in capsa serve: without heartbeats the node counts as gone after 30 s.
            while True:
                await asyncio.sleep(2.0)
                await s.heartbeat()

        beats = asyncio.create_task(beat())
        try:
            yield s
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
    finally:
        if control is not None:
            await control.stop()
        if node is not None:
            await node.stop()
        await agent.close()


async def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def _problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["code"] == code, response.text


async def _sh(c: httpx.AsyncClient, sid: str, cmd: str) -> str:
    result = await _ok(await c.post(f"/sessions/{sid}/commands", json={"cmd": cmd, "timeout": 60}))
    assert result["exit_code"] == 0, result
    return str(result["stdout"])


async def _create(c: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    created: dict[str, Any] = await _ok(await c.post("/sessions", json={"timeout": 900, **body}), 201)
    assert created["state"] == "running"
    return created


async def _counter(c: httpx.AsyncClient, sid: str) -> int:
    """The guest's counter (0 before its first tick)."""
    return int((await _sh(c, sid, f"cat {COUNTER_FILE} 2>/dev/null || echo 0")).strip())


async def _snapshots(c: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await _ok(await c.get(f"/sessions/{sid}/snapshots")))["items"]
    return items


async def test_pause_resume_keeps_files_and_running_processes(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c, metadata={"who": "pause-test"})
        sid = ses["id"]
        await _sh(c, sid, "echo kept > /root/note")
        started = await c.post(f"/sessions/{sid}/commands", json={"cmd": COUNTER, "background": True})
        assert started.status_code == 201, started.text
        before = await counter_past(lambda: _counter(c, sid), 4)
        old_sandbox = _sandbox_of(stack, sid)
        paused = await _ok(await c.post(f"/sessions/{sid}/pause"))
        assert paused["state"] == "paused" and paused["pause_reason"] == "paused"
        assert old_sandbox not in {r.id for r in stack.agent.list()}  # the VM is gone
        snaps = await _snapshots(c, sid)
        assert [s["kind"] for s in snaps] == ["pause"] and snaps[0]["id"] in stack.snapshot_dirs()
        _problem(await c.post(f"/sessions/{sid}/commands", json={"cmd": "true"}), 409, "invalid_state")

        await asyncio.sleep(3.0)  # the guest clock would lag by this much without the node's clock refresh
        resumed = await _ok(await c.post(f"/sessions/{sid}/resume"))
        assert resumed["state"] == "running" and resumed["pause_reason"] is None
        assert abs(float(await _sh(c, sid, "date +%s.%N")) - time.time()) < 2.0
        assert await _sh(c, sid, "cat /root/note") == "kept\n"
        await goes_on(lambda: _counter(c, sid), before)  # the background process runs on from the pause
        procs = (await _ok(await c.get(f"/sessions/{sid}/processes")))["items"]
        assert any(p["running"] and "counter" in " ".join(p["cmd"]) for p in procs)

        # Roll back to an earlier snapshot: a file written after it is gone again.
        manual = await _ok(await c.post(f"/sessions/{sid}/snapshots", json={}), 201)
        assert manual["kind"] == "manual"
        await _sh(c, sid, "echo later > /root/note")
        restored = await _ok(await c.post(f"/sessions/{sid}/restore", json={"snapshot_id": manual["id"]}))
        assert restored["state"] == "running"
        assert await _sh(c, sid, "cat /root/note") == "kept\n"
        await _ok(await c.post(f"/sessions/{sid}/close"))


async def test_branch_into_three_then_diverge(stack: Stack) -> None:
    async with stack.client() as c:
        parent = await _create(c, metadata={"project": "p1"}, env={"ROLE": "parent"})
        pid = parent["id"]
        await _sh(c, pid, "echo base > /root/shared")
        branched = await _ok(await c.post(f"/sessions/{pid}/branch", json={"n": 3}), 201)
        kids = [k["id"] for k in branched["items"]]
        assert len(set(kids)) == 3 and pid not in kids
        for kid in branched["items"]:
            assert kid["state"] == "running" and kid["tenant"] == "acme"
            assert kid["metadata"] == {"project": "p1", "branched_from": pid}
        listed = (await _ok(await c.get("/sessions", params={"metadata.branched_from": pid})))["items"]
        assert {s["id"] for s in listed} == set(kids)
        for i, kid in enumerate(kids):
            assert await _sh(c, kid, "cat /root/shared") == "base\n"
            assert await _sh(c, kid, "echo $ROLE") == "parent\n"  # the session's env came along
            await _sh(c, kid, f"echo kid{i} > /root/shared")
        await _sh(c, pid, "echo parent-changed > /root/shared")
        for i, kid in enumerate(kids):
            assert await _sh(c, kid, "cat /root/shared") == f"kid{i}\n"
        assert await _sh(c, pid, "cat /root/shared") == "parent-changed\n"
        # Different random bytes in every branch (the node reseeded each one).
        samples = {await _sh(c, kid, "head -c 16 /dev/urandom | od -An -tx1") for kid in kids}
        assert len(samples) == 3
        for kid in kids:  # and the host's clock, not the snapshot's
            assert abs(float(await _sh(c, kid, "date +%s.%N")) - time.time()) < 2.0
        for sid in (*kids, pid):
            await _ok(await c.post(f"/sessions/{sid}/close"))


async def _wait(predicate: Any, what: str, limit: float = 120.0) -> Any:
    deadline = time.monotonic() + limit
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_killed_vm_resumes_from_latest_rolling_snapshot(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c, rolling_snapshots={"after_command": True, "keep": 2})
        sid = ses["id"]
        assert ses["rolling_snapshots"] == {"interval_s": None, "after_command": True, "keep": 2,
                                            "max_age_s": None}
        seen: list[str] = []
        for word in ("one", "two", "three"):
            before = {s["id"] for s in await _snapshots(c, sid)}
            await _sh(c, sid, f"echo {word} > /root/state")

            async def new_rolling(before: set[str] = before) -> list[dict[str, Any]]:
                items = await _snapshots(c, sid)
                return [s for s in items if s["kind"] == "rolling" and s["id"] not in before]

            made = await _wait(new_rolling, f"a rolling snapshot after '{word}'")
            seen.append(made[0]["id"])

        async def pruned() -> list[str]:
            # The newest snapshot is listed before the pass that took it prunes beyond ``keep``.
            rolling = [s["id"] for s in await _snapshots(c, sid) if s["kind"] == "rolling"]
            return rolling if len(rolling) <= 2 else []

        assert await _wait(pruned, "pruning to keep=2") == [seen[2], seen[1]]  # newest first
        dirs = stack.snapshot_dirs()
        assert seen[0] not in dirs and {seen[1], seen[2]} <= dirs  # the pruned one is gone from the node

        # Kill the VM process (SIGKILL): the node notices, the control plane pauses the session.
        record = next(r for r in stack.agent.list() if r.id == _sandbox_of(stack, sid))
        pid = record.sandbox.process.pid  # type: ignore[attr-defined]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

        async def lost() -> bool:
            # The stack's own heartbeat loop may report the dead VM first (then the node has already
            # dropped it): either way the session must stop running.
            if record.id in stack.agent.failed_sandboxes():
                await stack.heartbeat()
            return bool((await _ok(await c.get(f"/sessions/{sid}")))["state"] != "running")

        await _wait(lost, "the control plane to learn that the VM died", 60)
        info = await _ok(await c.get(f"/sessions/{sid}"))
        assert info["state"] == "paused", info
        assert seen[2] in info["pause_reason"]
        resumed = await _ok(await c.post(f"/sessions/{sid}/resume"))
        assert resumed["state"] == "running"
        assert await _sh(c, sid, "cat /root/state") == "three\n"
        await _ok(await c.post(f"/sessions/{sid}/close"))


def _sandbox_of(stack: Stack, session_id: str) -> str:
    """The session's current sandbox (not part of the public API: read from the control plane's DB)."""
    with contextlib.closing(sqlite3.connect(str(stack.state_dir / "capsa.db"))) as db:
        row = db.execute("SELECT sandbox_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
    assert row is not None and row[0], session_id
    return str(row[0])


async def test_close_deletes_snapshots_on_the_node(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c)
        sid = ses["id"]
        a = await _ok(await c.post(f"/sessions/{sid}/snapshots", json={}), 201)
        await _sh(c, sid, "echo x > /root/x")
        b = await _ok(await c.post(f"/sessions/{sid}/snapshots", json={}), 201)
        assert {a["id"], b["id"]} <= stack.snapshot_dirs()
        await _ok(await c.post(f"/sessions/{sid}/close"))
        assert not ({a["id"], b["id"]} & stack.snapshot_dirs())
        assert await _snapshots(c, sid) == []

        kept = await _create(c, keep_snapshots=True)
        k = await _ok(await c.post(f"/sessions/{kept['id']}/snapshots", json={}), 201)
        await _ok(await c.post(f"/sessions/{kept['id']}/close"))
        assert k["id"] in stack.snapshot_dirs()  # retained by the session's policy
        assert [s["id"] for s in await _snapshots(c, kept["id"])] == [k["id"]]


async def test_on_timeout_pause_then_resume(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c, on_timeout="pause")
        sid = ses["id"]
        await _sh(c, sid, "echo before-timeout > /root/t")
        await _ok(await c.post(f"/sessions/{sid}/timeout", json={"timeout": 1}))

        async def paused() -> dict[str, Any] | None:
            info: dict[str, Any] = await _ok(await c.get(f"/sessions/{sid}"))
            return info if info["state"] == "paused" else None

        info = await _wait(paused, "the reaper to pause the session", 60)
        assert info["pause_reason"] == "timeout"
        await asyncio.sleep(1.0)  # the reaper keeps it paused (it does not close it)
        assert (await _ok(await c.get(f"/sessions/{sid}")))["state"] == "paused"
        resumed = await _ok(await c.post(f"/sessions/{sid}/resume"))
        assert resumed["state"] == "running"
        assert await _sh(c, sid, "cat /root/t") == "before-timeout\n"
        await _ok(await c.post(f"/sessions/{sid}/close"))


async def test_bad_requests_change_nothing(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c)
        sid = ses["id"]
        snap = await _ok(await c.post(f"/sessions/{sid}/snapshots", json={}), 201)
        other = await _create(c)
        other_snap = await _ok(await c.post(f"/sessions/{other['id']}/snapshots", json={}), 201)

        async def picture() -> tuple[Any, ...]:
            info = await _ok(await c.get(f"/sessions/{sid}"))
            listed = await _ok(await c.get("/sessions", params={"limit": 500}))
            return (info["state"], info["updated_at"], [s["id"] for s in await _snapshots(c, sid)],
                    sorted(s["id"] for s in listed["items"]), sorted(r.id for r in stack.agent.list()),
                    sorted(stack.snapshot_dirs()))

        before = await picture()
        _problem(await c.post(f"/sessions/{sid}/resume"), 409, "invalid_state")  # it is running
        for n in (0, 10000, -1):
            _problem(await c.post(f"/sessions/{sid}/branch", json={"n": n}), 422, "validation_error")
        _problem(await c.post(f"/sessions/{sid}/branch", json={"n": "3"}), 422, "validation_error")
        _problem(await c.post("/sessions", json={"template": "no-such-template"}), 404, "template_not_found")
        _problem(await c.post(f"/sessions/{sid}/restore", json={"snapshot_id": "snap_" + "0" * 20}), 404,
                 "snapshot_not_found")
        _problem(await c.post(f"/sessions/{sid}/restore", json={"snapshot_id": other_snap["id"]}), 404,
                 "snapshot_not_found")
        _problem(await c.post(f"/sessions/{sid}/restore", json={"snapshot_id": "../x"}), 422,
                 "validation_error")
        _problem(await c.post("/sessions", json={"on_timeout": "explode"}), 422, "validation_error")
        _problem(await c.post("/sessions", json={"rolling_snapshots": {"keep": 0}}), 422, "validation_error")
        async with stack.client(await stack.tenant_key("intruder")) as other_tenant:
            for path in ("pause", "resume", "snapshots"):
                _problem(await other_tenant.post(f"/sessions/{sid}/{path}", json={}), 404, "not_found")
            _problem(await other_tenant.post(f"/sessions/{sid}/branch", json={"n": 1}), 404, "not_found")
            _problem(await other_tenant.get(f"/sessions/{sid}/snapshots"), 404, "not_found")
            _problem(await other_tenant.post(f"/sessions/{sid}/restore", json={"snapshot_id": snap["id"]}),
                     404, "not_found")
        assert await picture() == before
        assert snap["id"] in before[-1]

        # Pause twice: the second is refused and changes nothing.
        await _ok(await c.post(f"/sessions/{sid}/pause"))
        paused = await picture()
        _problem(await c.post(f"/sessions/{sid}/pause"), 409, "invalid_state")
        _problem(await c.post(f"/sessions/{sid}/snapshots", json={}), 409, "invalid_state")
        assert await picture() == paused

        # A closed session cannot be resumed, paused or branched.
        await _ok(await c.post(f"/sessions/{sid}/close"))
        closed = await picture()
        _problem(await c.post(f"/sessions/{sid}/resume"), 409, "invalid_state")
        _problem(await c.post(f"/sessions/{sid}/pause"), 409, "invalid_state")
        _problem(await c.post(f"/sessions/{sid}/branch", json={"n": 2}), 409, "invalid_state")
        assert await picture() == closed
        await _ok(await c.post(f"/sessions/{other['id']}/close"))


async def test_sdk_async_sync_and_cli(stack: Stack) -> None:
    from click.testing import CliRunner

    from capsa.cli.main import cli
    from capsa.sdk import AsyncSession, InvalidState, Session

    url, key = stack.control.url, stack.key
    s = await AsyncSession.create(timeout=900, metadata={"via": "sdk"}, rolling_snapshots={"keep": 2},
                                  api_url=url, api_key=key)
    assert s.info.rolling_snapshots is not None
    assert s.info.rolling_snapshots.model_dump() == {"interval_s": None, "after_command": False, "keep": 2,
                                                     "max_age_s": None}
    await s.files.write("/root/sdk", "first\n")
    snap = await s.snapshots.create()
    assert snap.kind == "manual" and [x.id for x in await s.snapshots.list()] == [snap.id]
    await s.files.write("/root/sdk", "second\n")
    await s.snapshots.restore(snap.id)
    assert s.state == "running" and await s.files.read("/root/sdk") == "first\n"
    assert (await s.pause()).state == "paused"
    with pytest.raises(InvalidState):
        await s.pause()
    again = await AsyncSession.resume(s.id, api_url=url, api_key=key)  # the class form attaches and resumes
    assert again.state == "running" and await again.files.read("/root/sdk") == "first\n"
    kids = await again.branch(2)
    assert [k.info.metadata for k in kids] == [{"via": "sdk", "branched_from": s.id}] * 2
    assert {await k.files.read("/root/sdk") for k in kids} == {"first\n"}
    for kid in kids:
        await kid.close()
    await again.pause()
    assert (await again.resume()).state == "running"  # the instance form resumes in place
    await again.disconnect()
    await s.disconnect()
    sid = s.id

    def blocking_part() -> None:
        env = {"CAPSA_API_URL": stack.control.url, "CAPSA_API_KEY": stack.key}
        runner = CliRunner()

        def capsa(*args: str, code: int = 0) -> Any:
            result = runner.invoke(cli, list(args), env=env)
            assert result.exit_code == code, (args, result.output)
            return json.loads(result.output) if "--json" in args else result.output

        assert capsa("pause", sid, "--json")["state"] == "paused"
        assert capsa("resume", sid, "--json")["state"] == "running"
        taken = capsa("snapshots", sid, "--take").strip()
        assert taken.startswith("snap_")
        listed = capsa("snapshots", sid, "--json")["items"]
        assert listed[0]["id"] == taken and {"pause", "manual"} <= {x["kind"] for x in listed}
        assert taken in capsa("snapshots", sid)  # the table
        assert capsa("snapshots", sid, "--restore", taken, "--json")["state"] == "running"
        kids = capsa("branch", sid, "-n", "2", "--json")["items"]
        assert len(kids) == 2 and all(k["metadata"]["branched_from"] == sid for k in kids)
        assert "0 is not in the range" in capsa("branch", sid, "-n", "0", code=2)
        assert "invalid_state" in capsa("resume", sid, code=1)  # running, not paused
        capsa("close", *(k["id"] for k in kids))

        session = Session.connect(sid, api_url=url, api_key=key)
        assert session.pause().state == "paused"
        session.disconnect()
        resumed = Session.resume(sid, api_url=url, api_key=key)
        assert resumed.state == "running" and resumed.files.read("/root/sdk") == "first\n"
        assert [k.state for k in resumed.branch(1)] == ["running"]
        assert resumed.snapshots.list()[0].kind == "branch"
        resumed.close()

    await asyncio.to_thread(blocking_part)


async def test_interval_rolling_snapshots_follow_activity(stack: Stack) -> None:
    async with stack.client() as c:
        ses = await _create(c, rolling_snapshots={"interval_s": 10, "keep": 1})
        sid = ses["id"]
        await _sh(c, sid, "echo active > /root/a")

        async def first() -> list[dict[str, Any]]:
            return [s for s in await _snapshots(c, sid) if s["kind"] == "rolling"]

        made = await _wait(first, "the first interval snapshot", 180)
        assert len(made) == 1
        await _sh(c, sid, "echo more > /root/a")  # activity: the next interval takes another, keep=1 prunes

        async def replaced() -> bool:
            now = [s["id"] for s in await _snapshots(c, sid) if s["kind"] == "rolling"]
            return len(now) == 1 and now[0] != made[0]["id"]

        await _wait(replaced, "the next interval snapshot", 180)
        assert made[0]["id"] not in stack.snapshot_dirs()
        await _ok(await c.post(f"/sessions/{sid}/close"))

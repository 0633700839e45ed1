"""The node API's templates, warm pool and snapshot operations with real VMs (QEMU microvm, TCG here).

One VM is cold-booted for the whole module (the base template); every sandbox after it is restored.
Everything goes through the node HTTP API (docs/node-snapshots.md) as the control plane would call it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from click.testing import CliRunner

from capsa.cli.main import cli
from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.node.agent.agent import NodeAgent
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from capsa.node.storage import StoragePool
from capsa.node.templates.build import build_template, load_spec
from capsa.node.templates.source import TemplateSource
from tests.support.counter import COUNTER_FILE, counter_past, counter_script
from tests.support.node_http import ok, sh
from tests.support.vm import template_node

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop btrfs pool, VM uids)"),
    pytest.mark.asyncio(loop_scope="module"),
]

COUNTER = counter_script(0.1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(state_dir: Path, pool: StoragePool, guest_image: GuestImage) -> AsyncIterator[NodeAgent]:
    async with template_node(state_dir, pool, guest_image, pool_size=1) as node:
        yield node


async def _counter(api: httpx.AsyncClient, sid: str) -> int:
    """The guest's counter (0 before its first tick)."""
    return int(await sh(api, sid, f"cat {COUNTER_FILE} 2>/dev/null || echo 0"))


async def _create(api: httpx.AsyncClient, template: str = "base") -> dict[str, Any]:
    sid = new_id("sbx")
    out: dict[str, Any] = await ok(await api.post("/sandboxes", json={"id": sid, "template": template}), 201)
    return out


async def _wait_pool_full(api: httpx.AsyncClient, limit: float = 120) -> None:
    """Until the base pool holds its one sandbox and no restore is under way."""
    deadline = time.monotonic() + limit
    while True:
        status = await ok(await api.get("/pool"))
        base = [t for t in status["templates"] if t["template"] == "base"]
        if base and base[0]["idle"] >= 1 and base[0]["restoring"] == 0:
            return
        assert time.monotonic() < deadline, "warm pool did not refill"
        await asyncio.sleep(0.2)


def _templates(agent: NodeAgent) -> TemplateSource:
    assert isinstance(agent.source, TemplateSource)
    return agent.source


def _runtime(agent: NodeAgent) -> QemuRuntime:
    assert isinstance(agent.runtime, QemuRuntime)
    return agent.runtime


def _pool_root(agent: NodeAgent) -> Path:
    return _runtime(agent).templates_dir.parent


def _listing(agent: NodeAgent) -> dict[str, list[str]]:
    root = _pool_root(agent)
    return {area: sorted(p.name for p in (root / area).iterdir()) for area in ("sandboxes", "snapshots",
                                                                             "templates")}


async def test_base_template_is_listed(api: httpx.AsyncClient) -> None:
    items = (await ok(await api.get("/templates")))["items"]
    base = [t for t in items if t["name"] == "base"]
    assert len(base) == 1 and base[0]["digest"].startswith("sha256:") and base[0]["memory_mib"] == 256
    shown = (await ok(await api.get("/templates/base")))["items"]
    assert shown[0]["digest"] == base[0]["digest"]
    assert "base" in (await ok(await api.get("/info")))["templates"]


def _source(agent: NodeAgent, sid: str) -> str:
    return agent.get(sid).source


def _thread_nices(sandbox: object) -> set[int]:
    """The niceness of every thread of a sandbox's QEMU (field 19 of /proc/<pid>/task/<tid>/stat)."""
    assert isinstance(sandbox, QemuSandbox) and sandbox.pid is not None
    task = Path(f"/proc/{sandbox.pid}/task")
    return {int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in task.iterdir()}


async def test_create_from_pool_then_on_demand_and_identity(api: httpx.AsyncClient,
                                                            agent: NodeAgent) -> None:
    await _wait_pool_full(api)
    # A pooled VM waits at the lowest CPU priority, every thread of it (vCPU threads included) ...
    warm = _templates(agent).warm
    (waiting,) = warm.pooled()
    assert _thread_nices(waiting) == {19}
    # No refill right after the take: with one restoring, the next create would wait for it
    # (WarmPool.take_soon, unit-tested) instead of restoring on demand.
    refill_delay, warm.refill_delay = warm.refill_delay, 15.0
    try:
        a = await _create(api)
        b = await _create(api)  # the pool has just been emptied and no refill runs: restored on demand
    finally:
        warm.refill_delay = refill_delay
    try:
        assert _source(agent, a["id"]) == "pool" and _source(agent, b["id"]) == "restore"
        # ... and serves at the normal one once bound; a restore on demand never left it.
        assert _thread_nices(agent.get(a["id"]).sandbox) == {0}
        assert _thread_nices(agent.get(b["id"]).sandbox) == {0}
        pool = {t["template"]: t for t in (await ok(await api.get("/pool")))["templates"]}["base"]
        assert pool["hits"] >= 1 and pool["misses"] >= 1
        metrics = (await api.get("http://node/metrics")).text
        assert 'capsa_pool_hits_total{memory_mib="256",template="base",vcpus="1"} 1.0' in metrics
        assert 'capsa_pool_misses_total{memory_mib="256",template="base",vcpus="1"}' in metrics
        assert 'capsa_sandbox_create_seconds_count{source="pool"}' in metrics
        # Two sandboxes from one template: their own randomness, the host's time, their own hostname.
        probe = ("python3 -c 'import os,time,socket; "
                 "print(os.urandom(16).hex(), time.time(), socket.gethostname())'")
        ra, ta, ha = (await sh(api, a["id"], probe)).split()
        rb, tb, hb = (await sh(api, b["id"], probe)).split()
        now = time.time()
        assert ra != rb
        assert abs(float(ta) - now) < 5 and abs(float(tb) - now) < 5
        assert ha == a["id"].replace("_", "-") and hb == b["id"].replace("_", "-")
    finally:
        for sb in (a, b):
            await ok(await api.delete(f"/sandboxes/{sb['id']}"), 204)


async def test_pause_restore_branch_and_cleanup(api: httpx.AsyncClient, agent: NodeAgent) -> None:
    sb = await _create(api)
    sid = sb["id"]
    await ok(await api.put(f"/sandboxes/{sid}/files/content", params={"path": "/root/note.txt"},
                            content=b"before the pause\n"))
    await ok(await api.post(f"/sandboxes/{sid}/processes", json={"cmd": ["sh", "-c", COUNTER]}))
    before = await counter_past(lambda: _counter(api, sid), 3)
    snap = await ok(await api.post(f"/sandboxes/{sid}/pause", json={}))
    assert snap["retain"] is True and snap["sandbox_id"] == sid
    assert (await api.get(f"/sandboxes/{sid}")).status_code == 404
    # The paused VM's files are gone; only the snapshot remains.
    runtime_ids = {s.id for s in _runtime(agent).list()}
    pooled = {s.id for s in _templates(agent).warm.pooled()}
    assert set(_listing(agent)["sandboxes"]) <= runtime_ids | pooled
    assert snap["id"] in _listing(agent)["snapshots"]

    resumed = await ok(await api.post(f"/snapshots/{snap['id']}/restore", json={"id": new_id("sbx")}), 201)
    rid = resumed["id"]
    try:
        assert resumed["source"] == "restore"
        assert await sh(api, rid, "cat /root/note.txt") == "before the pause\n"
        at = int(await sh(api, rid, "cat /tmp/counter"))
        assert before <= at < before + 50
        await counter_past(lambda: _counter(api, rid), at)  # it keeps counting

        # Branch into 3 from a snapshot of the resumed sandbox: each sees its files, then they diverge.
        await sh(api, rid, "echo parent > /root/shared.txt && sync")
        point = await ok(await api.post(f"/sandboxes/{rid}/snapshots", json={"retain": False}), 201)
        assert point["retain"] is False
        ids = [new_id("sbx") for _ in range(3)]
        resp = await api.post(f"/snapshots/{point['id']}/branch", json={"ids": ids})
        branches = (await ok(resp, 201))["items"]
        assert [b["id"] for b in branches] == ids
        metrics = (await api.get("http://node/metrics")).text
        running = [line for line in metrics.splitlines() if line.startswith("capsa_sandboxes_running ")]
        assert running and float(running[0].split()[1]) == len(agent.list()) >= 4  # rid and 3 branches
        try:
            seen = set()
            for i, bid in enumerate(ids):
                assert await sh(api, bid, "cat /root/shared.txt") == "parent\n"
                await sh(api, bid, f"echo branch{i} > /root/shared.txt")
                seen.add(await sh(api, bid, "python3 -c 'import os; print(os.urandom(16).hex())'"))
            await sh(api, rid, "echo parent-later > /root/later.txt")
            for i, bid in enumerate(ids):
                assert await sh(api, bid, "cat /root/shared.txt") == f"branch{i}\n"
                assert "later.txt" not in (await sh(api, bid, "ls /root")).split()
            assert len(seen) == 3
            assert await sh(api, rid, "cat /root/shared.txt") == "parent\n"
        finally:
            for bid in ids:
                await ok(await api.delete(f"/sandboxes/{bid}"), 204)

        listed = {s["id"] for s in (await ok(await api.get(f"/sandboxes/{rid}/snapshots")))["items"]}
        assert listed == {point["id"]}
        snap_dir = _pool_root(agent) / "snapshots" / point["id"]
        assert (snap_dir / "memory.ram").exists() and (snap_dir / "disk.img").exists()
        runtime_id = agent.get(rid).sandbox.id
        sandbox_dir = _pool_root(agent) / "sandboxes" / runtime_id
        assert (sandbox_dir / "disk.img").exists()
    finally:
        await ok(await api.delete(f"/sandboxes/{rid}"), 204)
    # Closing deletes the sandbox's disk and memory files and its non-retained snapshot.
    assert not sandbox_dir.exists()
    assert not snap_dir.exists()
    assert not (_runtime(agent).vms_dir / runtime_id).exists()
    # The pause snapshot is retained until it is deleted explicitly.
    assert (_pool_root(agent) / "snapshots" / snap["id"]).is_dir()
    await ok(await api.delete(f"/snapshots/{snap['id']}"), 204)
    assert not (_pool_root(agent) / "snapshots" / snap["id"]).exists()
    assert (await api.get(f"/snapshots/{snap['id']}")).status_code == 404


async def test_bad_requests_change_nothing(api: httpx.AsyncClient, agent: NodeAgent) -> None:
    await _wait_pool_full(api)
    sb = await _create(api)
    try:
        point = await ok(await api.post(f"/sandboxes/{sb['id']}/snapshots", json={}), 201)
        await _wait_pool_full(api)
        before_files = _listing(agent)
        before_sandboxes = (await ok(await api.get("/sandboxes")))["items"]
        before_pool = await ok(await api.get("/pool"))
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("POST", "/sandboxes", {"id": new_id("sbx"), "template": "no-such-template"}, 404,
             "template_not_found"),
            ("POST", f"/snapshots/{point['id']}/branch", {"ids": []}, 422, "invalid_branch_count"),
            ("POST", f"/snapshots/{point['id']}/branch", {"ids": [new_id("sbx") for _ in range(10_000)]}, 422,
             "invalid_branch_count"),
            ("POST", f"/snapshots/{new_id('snap')}/restore", {"id": new_id("sbx")}, 404,
             "snapshot_not_found"),
            ("POST", f"/snapshots/{new_id('snap')}/branch", {"ids": [new_id("sbx")]}, 404,
             "snapshot_not_found"),
            ("POST", f"/snapshots/{point['id']}/restore", {"id": sb["id"]}, 409, "already_exists"),
            ("POST", f"/snapshots/{point['id']}/branch", {"ids": [sb["id"]]}, 409, "already_exists"),
            ("DELETE", "/templates/base", {}, 409, "template_protected"),
            ("POST", f"/sandboxes/{new_id('sbx')}/pause", {}, 404, "sandbox_not_found"),
        ]
        for method, path, body, status, code in cases:
            resp = await api.request(method, path, json=body if method != "DELETE" else None)
            assert resp.status_code == status, (path, resp.text)
            assert resp.json()["code"] == code, (path, resp.text)
        assert _listing(agent) == before_files
        assert (await ok(await api.get("/sandboxes")))["items"] == before_sandboxes
        after_pool = await ok(await api.get("/pool"))
        assert [(t["template"], t["idle"], t["hits"], t["misses"]) for t in after_pool["templates"]] == \
            [(t["template"], t["idle"], t["hits"], t["misses"]) for t in before_pool["templates"]]
    finally:
        await ok(await api.delete(f"/sandboxes/{sb['id']}"), 204)


SPEC = """\
name: h1-tools
apt: [jq]
pip: [six==1.16.0]
files:
  - path: /opt/demo/hello.txt
    content: "hello from the spec\\n"
  - path: /opt/demo/data.bin
    source: data.bin
    mode: "0600"
commands:
  - echo "built with $GREETING" > /opt/demo/built.txt
env:
  GREETING: howdy
"""


async def test_template_build_create_and_remove(api: httpx.AsyncClient, agent: NodeAgent,
                                                tmp_path: Path, state_dir: Path) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "data.bin").write_bytes(b"\x00\x01binary")
    spec, sources = load_spec(tmp_path / "spec.yaml")
    steps: list[str] = []
    built = await build_template(_templates(agent).store, spec, sources, progress=steps.append)
    assert built.digest.startswith("sha256:") and any(s.startswith("apt:") for s in steps)
    # No build VM is left behind.
    assert not any(isinstance(s, QemuSandbox) and s.spec.labels.get("template-build")
                   for s in _runtime(agent).list())

    listed = (await ok(await api.get("/templates/h1-tools")))["items"]
    assert listed[0]["digest"] == built.digest and listed[0]["spec"]["env"] == {"GREETING": "howdy"}
    runner = CliRunner()
    out = runner.invoke(cli, ["template", "ls", "--json", "--state-dir", str(state_dir)])
    assert out.exit_code == 0, out.output
    assert {"base", "h1-tools"} <= {t["name"] for t in json.loads(out.output)}

    sb = await _create(api, "h1-tools")
    try:
        assert (await sh(api, sb["id"], "jq -n '1+2'")).strip() == "3"
        six = await sh(api, sb["id"], "python3 -c 'import six; print(six.__version__)'")
        assert six.strip() == "1.16.0"
        assert await sh(api, sb["id"], "cat /opt/demo/hello.txt") == "hello from the spec\n"
        assert await sh(api, sb["id"], "stat -c %a /opt/demo/data.bin") == "600\n"
        assert await sh(api, sb["id"], "cat /opt/demo/built.txt") == "built with howdy\n"
        assert await sh(api, sb["id"], "echo $GREETING") == "howdy\n"  # the template's env
    finally:
        await ok(await api.delete(f"/sandboxes/{sb['id']}"), 204)
    await ok(await api.delete("/templates/h1-tools"), 204)
    assert not any(n.startswith("tpl-h1-tools-") for n in _listing(agent)["templates"])
    resp = await api.post("/sandboxes", json={"id": new_id("sbx"), "template": "h1-tools"})
    assert resp.status_code == 404 and resp.json()["code"] == "template_not_found"


async def test_template_cli_build_show_rm(api: httpx.AsyncClient, agent: NodeAgent, tmp_path: Path,
                                          state_dir: Path) -> None:
    """`capsa template build|show|rm` as a user runs them, on the node's state directory."""
    (tmp_path / "spec.yaml").write_text("name: h1-cli\nfiles:\n  - {path: /etc/h1-cli, content: cli}\n"
                                        "commands: ['echo done > /root/cli-built']\n")
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        # In a thread: the CLI runs its own event loop.
        return runner.invoke(cli, ["template", *args, "--state-dir", str(state_dir)])

    built = await asyncio.to_thread(invoke, "build", str(tmp_path / "spec.yaml"), "--json")
    assert built.exit_code == 0, built.output
    assert "command 1/1" in built.output  # progress lines (stderr, mixed in by CliRunner)
    shown = await asyncio.to_thread(invoke, "show", "h1-cli", "--json")
    assert shown.exit_code == 0 and '"h1-cli"' in shown.output
    sb = await _create(api, "h1-cli")  # the running node sees the new template
    try:
        assert await sh(api, sb["id"], "cat /etc/h1-cli /root/cli-built") == "clidone\n"
    finally:
        await ok(await api.delete(f"/sandboxes/{sb['id']}"), 204)
    removed = await asyncio.to_thread(invoke, "rm", "h1-cli")
    assert removed.exit_code == 0, removed.output
    again = await asyncio.to_thread(invoke, "rm", "h1-cli")
    assert again.exit_code == 1 and "template_not_found" in again.output
    base = await asyncio.to_thread(invoke, "rm", "base")
    assert base.exit_code == 1 and "template_protected" in base.output
    assert not any(n.startswith("tpl-h1-cli-") for n in _listing(agent)["templates"])

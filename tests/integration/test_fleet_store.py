"""Sessions that outlive their node through the fleet's store (issue 29), with real processes: one
``capsa control`` on PostgreSQL and ``capsa node`` processes with their own state directories, all writing
their snapshots to one store — a real S3 server (Swift with s3api) or a directory.

Proves: resume, failover (with fencing) and drain move sessions between nodes through the store with their
files, running processes and policy; a template is built once per fleet; nothing is left on the host.
Each test runs inside :func:`_fleet`, which starts the control plane(s), and stops every process and checks
what the nodes left behind at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import zstandard
from prometheus_client.parser import text_string_to_metric_families

from capsa.common.settings import Settings
from capsa.control.keys import generate_key
from capsa.node.storage.mounts import mounts
from capsa.node.templates.cache import STORE_KIND
from capsa.sdk import AsyncClient, AsyncSession
from capsa.store import ObjectStore, open_store
from capsa.store.bundles import list_bundles
from tests.support.counter import counter_past, counter_script, goes_on, session_counter
from tests.support.fleet import cli, enrol_token, listed_nodes, start_control, start_node
from tests.support.leftovers import wait_no_node_leftovers
from tests.support.postgres import PgCluster
from tests.support.processes import qemu_pids
from tests.support.s3_server import S3Server
from tests.support.served import Served, serve_workdir

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(1500)]

POLICY = {"domains": [{"domain": "api.allowed.test"}]}  # a networked session (a browser needs one)
COUNTER = counter_script()

@pytest.fixture
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-fleet-") as path:
        yield path


@pytest.fixture(params=["s3", "directory"])
def store_env(request: pytest.FixtureRequest, workdir: Path) -> dict[str, str]:
    if request.param == "directory":
        return {"CAPSA_STORE_URL": (workdir / "store").as_uri()}
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = "fleet-" + secrets.token_hex(4)
    server.make_bucket(bucket)
    return {"CAPSA_STORE_URL": f"s3://{bucket}/capsa", **server.env()}


FAST = {"CAPSA_NODE_DEAD_AFTER_S": "10", "CAPSA_NODE_HEARTBEAT_TIMEOUT": "10"}
"""Control settings of the failover tests: a node is declared dead 10 s after its last heartbeat (nodes
send one every 5 s)."""


@dataclass
class Fleet:
    workdir: Path
    admin: str
    store_env: dict[str, str]
    control: Served
    client: AsyncClient
    started: list[Served] = field(default_factory=list)

    def node(self, name: str, env: Mapping[str, str] | None = None, *, token: str | None = None
             ) -> tuple[Served, str]:
        """``capsa node`` NAME on the store, enrolled with a new token (``token``: a restart that has one)."""
        node, node_id = start_node(self.workdir, name, self.control.url,
                                   token or enrol_token(self.control.url, self.admin),
                                   {**self.store_env, **(env or {})})
        self.started.append(node)
        return node, node_id

    def gone(self, node: Served) -> None:
        """``node`` was stopped or killed by the test: not this fleet's to stop any more."""
        self.started.remove(node)


@contextlib.asynccontextmanager
async def _fleet(pg: PgCluster, workdir: Path, store_env: dict[str, str], *, replicas: int = 1,
                 control_env: Mapping[str, str] | None = None) -> AsyncIterator[Fleet]:
    """``replicas`` ``capsa control`` processes on one new database; at the end every process is stopped
    (each must exit 0) and nothing of the nodes may be left on the host."""
    admin, db_url = generate_key().full, pg.new_database()
    controls = [start_control(workdir, db_url, admin, control_env) for _ in range(replicas)]
    fleet = Fleet(workdir, admin, store_env, controls[0], AsyncClient(controls[0].url, admin), list(controls))
    try:
        yield fleet
    finally:
        await fleet.client.aclose()
        codes = {proc.stdout.name: proc.stop(signal.SIGTERM, timeout=120) for proc in reversed(fleet.started)}
        left = _leftovers(workdir)
    assert all(code == 0 for code in codes.values()), codes
    assert left == [], left


async def _running_on(fleet: Fleet, session_id: str, node_id: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while (info := await fleet.client.get_session(session_id)).state != "running" or info.node_id != node_id:
        assert info.state != "paused" and time.monotonic() < deadline, (
            info, {p.stdout.name: p.errors(4000) for p in fleet.started})
        await asyncio.sleep(0.5)


async def _metric_sum(fleet: Fleet, controls: int, name: str, **labels: str) -> float:
    """``name{labels}`` summed over the first ``controls`` replicas' ``/metrics``, as Prometheus would."""
    total = 0.0
    for control in fleet.started[:controls]:
        async with httpx.AsyncClient(base_url=control.url,
                                     headers={"Authorization": f"Bearer {fleet.admin}"}) as http:
            response = await http.get("/metrics")
        assert response.status_code == 200, response.text
        total += sum(s.value for family in text_string_to_metric_families(response.text)
                     for s in family.samples if s.name == name and s.labels == labels)
    return total


async def _stored_snapshot(client: AsyncClient, session_id: str, limit_s: float = 300) -> None:
    """Until the session has a snapshot in the store (a rolling one after its last command)."""
    deadline = time.monotonic() + limit_s
    while not [s for s in await client.list_snapshots(session_id) if s.stored]:
        assert time.monotonic() < deadline, await client.list_snapshots(session_id)
        await asyncio.sleep(1.0)


async def test_a_paused_session_resumes_on_another_node_from_the_store(
        pg: PgCluster, workdir: Path, store_env: dict[str, str]) -> None:
    async with _fleet(pg, workdir, store_env) as fleet:
        client = fleet.client
        node_a, id_a = fleet.node("node-a")
        nodes = listed_nodes(fleet.control.url, fleet.admin)
        assert str(nodes[id_a]["store"]).startswith(store_env["CAPSA_STORE_URL"])
        session = await AsyncSession.create(timeout=900, client=client)
        assert (await client.get_session(session.id)).node_id == id_a
        await session.files.write("/root/note", "kept on a\n")
        await session.commands.run(COUNTER, background=True)
        before = await counter_past(lambda: session_counter(session), 4)
        await session.pause()
        [snap] = await client.list_snapshots(session.id)
        assert snap.kind == "pause" and snap.node_id == id_a and snap.stored

        _, id_b = fleet.node("node-b")
        assert node_a.stop(signal.SIGTERM, timeout=120) == 0, node_a.errors()
        fleet.gone(node_a)
        assert wait_no_node_leftovers(node_a.state_dir, timeout=60) == []

        resumed = await AsyncSession.resume(session.id, client=client)
        assert resumed.id == session.id
        info = await client.get_session(session.id)
        assert info.state == "running" and info.node_id == id_b
        assert await resumed.files.read("/root/note") == "kept on a\n"
        await goes_on(lambda: session_counter(resumed), before)  # from where it was at the pause
        await resumed.close()


async def test_a_session_of_a_killed_node_runs_on_another_from_its_rolling_snapshot(
        pg: PgCluster, workdir: Path, store_env: dict[str, str]) -> None:
    # Two replicas on one database: both reapers see the dead node, one recovers the session (one `recover`
    # event below).
    async with _fleet(pg, workdir, store_env, replicas=2, control_env=FAST) as fleet:
        client = fleet.client
        node_a, id_a = fleet.node("node-a")
        session = await AsyncSession.create(timeout=900, client=client, policy=POLICY,
                                            rolling_snapshots={"interval_s": 60, "after_command": True})
        await session.files.write("/root/note", "written on a\n")
        await session.commands.run(COUNTER, background=True)
        before = await counter_past(lambda: session_counter(session), 4)
        await session.commands.run("true")  # a finished command: a rolling snapshot follows
        await _stored_snapshot(client, session.id)
        _, id_b = fleet.node("node-b")

        killed = _kill_node(node_a)
        fleet.gone(node_a)
        assert killed, "node A ran no QEMU"
        t0 = time.monotonic()
        await _running_on(fleet, session.id, id_b)
        failover_s = time.monotonic() - t0
        resumed = await AsyncSession.connect(session.id, client=client)
        assert await resumed.files.read("/root/note") == "written on a\n"
        await goes_on(lambda: session_counter(resumed), before)  # from the snapshot on
        kept = (await resumed.egress.policy()).policy
        assert kept is not None and [d["domain"] for d in kept["domains"]] == ["api.allowed.test"]
        assert await _denied_on_this_node(resumed), "node B's broker did not apply the session's policy"
        trail = [e for e in await client.audit.list(session_id=session.id) if e.action == "recover"]
        assert len(trail) == 1 and trail[0].detail["from_node"] == id_a and trail[0].detail["node"] == id_b
        # Both replicas' reapers saw the dead node; the one that won the session counted it (sum: 1).
        assert await _metric_sum(fleet, 2, "capsa_session_recoveries_total", result="recovered") == 1
        assert await _metric_sum(fleet, 2, "capsa_session_operation_duration_seconds_count",
                                 operation="recover", outcome="ok") == 1
        print(f"failover: {failover_s:.1f} s from kill -9 to running on node B")

        # Node A comes back on its state dir: it runs nothing of the session, which stays on B.
        node_a, again = fleet.node("node-a", token="unused")
        assert again == id_a
        await asyncio.sleep(6.0)  # a heartbeat of node A
        assert not qemu_pids(node_a.state_dir)
        info = await client.get_session(session.id)
        assert info.state == "running" and info.node_id == id_b
        assert (await resumed.commands.run("cat /root/note")).stdout == "written on a\n"
        await resumed.close()


@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
async def test_drain_moves_sessions_with_their_processes_and_policy(
        pg: PgCluster, workdir: Path, store_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    async with _fleet(pg, workdir, store_env) as fleet:
        client = fleet.client
        _, id_a = fleet.node("node-a")
        secret = "sk-fleet-" + secrets.token_hex(16)
        await client.secrets.create("upstream", secret)
        policy = {"domains": [{"domain": "api.allowed.test"}],
                  "secrets": [{"secret": "upstream", "domain": "api.allowed.test", "env": "API_KEY"}]}
        sessions = [await AsyncSession.create(timeout=900, client=client, policy=policy),
                    await AsyncSession.create(timeout=900, client=client),
                    await AsyncSession.create(timeout=900, client=client)]
        for s in sessions:
            await s.files.write("/root/note", f"{s.id}\n")
            await s.commands.run(COUNTER, background=True)
        _, id_b = fleet.node("node-b")
        before = {s.id: await counter_past(functools.partial(session_counter, s), 4) for s in sessions}

        t0 = time.monotonic()
        drained = await asyncio.to_thread(cli, fleet.control.url, fleet.admin, "nodes", "drain", id_a,
                                          "--json", timeout=900)
        drain_s = time.monotonic() - t0
        assert drained.returncode == 0, drained.stderr
        done = json.loads(drained.stdout)
        assert sorted(done["moved"]) == sorted(s.id for s in sessions) and done["stayed"] == []
        assert done["drained"] and done["node"]["draining"]
        print(f"drain: {drain_s:.1f} s for {len(sessions)} sessions ({drain_s / len(sessions):.1f} s each)")
        for s in sessions:
            info = await client.get_session(s.id)
            assert info.state == "running" and info.node_id == id_b, info
            assert await s.files.read("/root/note") == f"{s.id}\n"
            await goes_on(functools.partial(session_counter, s), before[s.id])
        # The networked session's policy holds on node B: it names only api.allowed.test (the request is made
        # after the move, so its deny comes from node B's broker).
        networked = sessions[0]
        kept = (await networked.egress.policy()).policy
        assert kept is not None and [d["domain"] for d in kept["domains"]] == ["api.allowed.test"]
        placeholder = (await networked.commands.run("printenv API_KEY", timeout=60)).stdout.strip()
        assert placeholder.startswith("capsa_ph_") and secret not in placeholder
        assert await _denied_on_this_node(networked), await networked.egress.audit()

        # A drained node gets no new session until it is undrained.
        fresh = await AsyncSession.create(timeout=600, client=client)
        assert (await client.get_session(fresh.id)).node_id == id_b
        undrained = await asyncio.to_thread(cli, fleet.control.url, fleet.admin, "nodes", "undrain", id_a,
                                            "--json")
        assert undrained.returncode == 0 and json.loads(undrained.stdout)["draining"] is False
        # Every object of the store (chunks decompressed): the snapshots of a session holding a secret
        # binding carry its placeholder, never the secret's value.
        for name, value in store_env.items():  # the S3 credentials
            monkeypatch.setenv(name, value)
        store = open_store(store_env["CAPSA_STORE_URL"], s3_endpoint=store_env["CAPSA_STORE_S3_ENDPOINT"])
        found = _scan_store(store, [secret.encode(), placeholder.encode()])
        assert found[secret.encode()] == 0 and found[placeholder.encode()] > 0, found
        for s in [*sessions, fresh]:
            await s.close()


@pytest.mark.shipped_templates
@pytest.mark.parametrize("store_env", ["directory"], indirect=True)
async def test_a_template_in_the_store_is_used_by_a_node_that_never_built_it(
        pg: PgCluster, workdir: Path, store_env: dict[str, str]) -> None:
    """Node A has the browser template (this host's cache) and puts it in the store on first use; node B,
    with a cache of its own that holds only the guest image, serves a browser session from the store."""
    store = open_store(store_env["CAPSA_STORE_URL"])
    async with _fleet(pg, workdir, store_env) as fleet:
        client = fleet.client
        node_a, _ = fleet.node("node-a")
        on_a = await AsyncSession.create(template="browser", memory_mib=1024, timeout=900, client=client,
                                         policy=POLICY)
        await on_a.close()
        deadline = time.monotonic() + 600
        while not [n for n in list_bundles(store, STORE_KIND) if n.startswith("browser.")]:
            assert time.monotonic() < deadline, node_a.errors()
            await asyncio.sleep(2.0)
        # Node A goes; node B starts with an empty template cache (the guest image linked in).
        assert node_a.stop(signal.SIGTERM, timeout=120) == 0
        fleet.gone(node_a)
        cache_b = workdir / "cache-b"
        cache_b.mkdir()
        shutil.copytree(Settings().cache_dir / "images", cache_b / "images", copy_function=os.link)
        node_b, id_b = fleet.node("node-b", {"CAPSA_CACHE_DIR": str(cache_b)})
        t0 = time.monotonic()
        on_b = await AsyncSession.create(template="browser", memory_mib=1024, timeout=900, client=client,
                                         policy=POLICY)
        import_s = time.monotonic() - t0
        assert (await client.get_session(on_b.id)).node_id == id_b
        out = await on_b.commands.run("pgrep -c chromium || pgrep -c chrome", timeout=60)
        assert int(out.stdout.strip() or 0) > 0, out
        log = node_b.stderr.read_text()
        assert "browser" in log and "pulled from the store" in log, log[-3000:]
        assert "building shipped template browser" not in log
        print(f"template import: browser session on a fresh node in {import_s:.1f} s")
        await on_b.close()


@pytest.mark.parametrize("store_env", ["directory"], indirect=True)
async def test_a_node_that_returns_after_its_sessions_moved_destroys_its_stale_sandboxes(
        pg: PgCluster, workdir: Path, store_env: dict[str, str]) -> None:
    """Fencing: node A is frozen (SIGSTOP: a partition; its VM keeps running), declared dead, and its session
    recovered on B; when A thaws, its heartbeat answer names the old sandbox and A destroys it."""
    async with _fleet(pg, workdir, store_env, control_env=FAST) as fleet:
        client = fleet.client
        node_a, _ = fleet.node("node-a")
        session = await AsyncSession.create(timeout=900, client=client,
                                            rolling_snapshots={"after_command": True})
        await session.commands.run("echo before > /root/note")
        await _stored_snapshot(client, session.id)
        _, id_b = fleet.node("node-b")
        assert qemu_pids(node_a.state_dir)
        node_a.proc.send_signal(signal.SIGSTOP)
        try:
            await _running_on(fleet, session.id, id_b)
            assert qemu_pids(node_a.state_dir)  # the stale VM still runs while A is frozen
        finally:
            node_a.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        while qemu_pids(node_a.state_dir):
            assert time.monotonic() < deadline, "node A kept the recovered session's old VM"
            await asyncio.sleep(1.0)
        info = await client.get_session(session.id)
        assert info.state == "running" and info.node_id == id_b
        again = await AsyncSession.connect(session.id, client=client)
        assert await again.files.read("/root/note") == "before\n"
        await again.close()


def _kill_node(node: Served) -> list[int]:
    """``kill -9`` of the node process and of every process of its state dir (its QEMUs): a host lost."""
    node.proc.kill()
    node.proc.wait(30)
    found = subprocess.run(["pgrep", "-f", str(node.state_dir)], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _scan_store(store: ObjectStore, needles: list[bytes]) -> dict[bytes, int]:
    """How many of the store's objects hold each needle (chunks decompressed)."""
    found = dict.fromkeys(needles, 0)
    for obj in store.list(""):
        data = store.get(obj.key)
        if obj.key.startswith("chunks/"):
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=64 << 20)
        for needle in needles:
            found[needle] += needle in data
    return found


async def _denied_on_this_node(session: AsyncSession) -> bool:
    """A name the session's policy does not allow is refused by the broker of the node it runs on now
    (the lookup is made now, so the deny event is from that node), within a minute."""
    lookup = ("import socket\ntry:\n socket.getaddrinfo('not-allowed.test', 443)\n"
              "except OSError as e:\n print(e)")
    refused = await session.commands.run(["python3", "-c", lookup], timeout=60)
    assert refused.exit_code == 0 and refused.stdout.strip(), refused
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        denied = await session.egress.audit(decision="deny")
        if [e for e in denied if "not-allowed.test" in (e.destination or "")]:
            return True
        await asyncio.sleep(1.0)
    return False


def _leftovers(workdir: Path) -> list[str]:
    """What the nodes of ``workdir`` left behind once stopped (VMs, mounts, loop devices, namespaces); a
    killed node's mount is unmounted here so a failed test leaves the host clean, but it is still listed."""
    left: list[str] = []
    for state in sorted(workdir.glob("node-*")):
        found = wait_no_node_leftovers(state, timeout=60)
        left += found
        for mount in mounts():
            if mount.mount_point.is_relative_to(state.resolve()):
                subprocess.run(["umount", "-l", str(mount.mount_point)], check=False)
    return left

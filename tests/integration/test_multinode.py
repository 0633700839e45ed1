"""Several hosts' worth of capsa on this machine: one PostgreSQL, two ``capsa control`` replicas on it and two
``capsa node`` processes with their own state directories, all started as a user would start them.

Proves: sessions land on both nodes and work there (commands, files, pause/resume, branch); a session made
through one replica is used through the other; SIGTERM of one node pauses or fails its own sessions, leaves
the other node's untouched and leaves nothing of it on the host; the rest stop cleanly too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.control.keys import generate_key
from capsa.sdk import AsyncClient, AsyncSession
from tests.support.fleet import enrol_token, start_control, start_node
from tests.support.fleet import listed_nodes as _nodes
from tests.support.leftovers import wait_no_node_leftovers
from tests.support.postgres import PgCluster, postgres_missing_reason
from tests.support.served import CAPSA, ROOT, Served, free_port, serve_workdir

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(1500)]

if os.geteuid() != 0:
    pytest.skip("nodes need root (VM uids, storage pool, namespaces)", allow_module_level=True)
if (missing := postgres_missing_reason()) is not None:
    pytest.skip(missing, allow_module_level=True)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-mn-") as path:
        yield path


async def _state(client: AsyncClient, session_id: str) -> str:
    return (await client.get_session(session_id)).state


async def test_two_nodes_two_replicas_one_database(pg: PgCluster, workdir: Path) -> None:
    admin = generate_key().full
    db_url = pg.new_database()
    control = start_control(workdir, db_url, admin)
    replica = start_control(workdir, db_url, admin)
    started: list[Served] = [control, replica]
    try:
        tokens = [enrol_token(control.url, admin) for _ in range(2)]
        node_a, id_a = start_node(workdir, "node-a", control.url, tokens[0])
        started.append(node_a)
        node_b, id_b = start_node(workdir, "node-b", control.url, tokens[1])
        started.append(node_b)
        assert id_a != id_b
        # An enrolment token works once.
        reuse = [*CAPSA, "node", "--control-url", control.url, "--enrol-token", tokens[0], "--state-dir",
                 str(workdir / "node-c"), "--listen", f"127.0.0.1:{free_port()}", "--accel", "tcg"]
        again = await asyncio.to_thread(subprocess.run, reuse, capture_output=True, text=True, timeout=300,
                                        cwd=ROOT)
        assert again.returncode != 0 and "error" in again.stderr.lower(), again.stderr
        # The refusal is one line, the last (the node's log lines go to stderr too, before it).
        lines = again.stderr.strip().splitlines()
        assert [line for line in lines if line.startswith("error:")] == lines[-1:], again.stderr
        assert "enrolment token" in lines[-1], again.stderr
        wait_no_node_leftovers(workdir / "node-c")

        listed = _nodes(control.url, admin)
        assert listed[id_a]["healthy"] and listed[id_b]["healthy"], listed

        one = AsyncClient(control.url, admin)
        two = AsyncClient(replica.url, admin)
        sessions = [await AsyncSession.create(timeout=900, client=one) for _ in range(4)]
        where = {s.id: (await one.get_session(s.id)).node_id for s in sessions}
        assert set(where.values()) == {id_a, id_b}, where
        for s in sessions:
            # Made through one replica, used through the other.
            other = await AsyncSession.connect(s.id, client=two)
            result = await other.commands.run(f"echo {s.id} > /tmp/who; cat /tmp/who", timeout=60)
            assert result.exit_code == 0 and result.stdout.strip() == s.id
            assert (await s.files.read("/tmp/who")).strip() == s.id

        on_a = [s for s in sessions if where[s.id] == id_a]
        on_b = [s for s in sessions if where[s.id] == id_b]
        # Pause/resume on A, branch on B: each stays on the node that holds its snapshot.
        await on_a[0].pause()
        assert await _state(one, on_a[0].id) == "paused"
        resumed = await AsyncSession.resume(on_a[0].id, client=two)
        assert (await resumed.files.read("/tmp/who")).strip() == on_a[0].id
        branches = await on_b[0].branch(2)
        for br in branches:
            assert (await one.get_session(br.id)).node_id == id_b
            out = await br.commands.run("cat /tmp/who", timeout=60)
            assert out.stdout.strip() == on_b[0].id
        await branches[0].files.write("/tmp/mine", "0")
        assert not [e for e in await branches[1].files.list("/tmp") if e.name == "mine"]

        # SIGTERM of node A: its sessions are paused or failed, B's untouched, nothing of A left.
        assert node_a.stop(signal.SIGTERM, timeout=120) == 0, node_a.errors()
        left = wait_no_node_leftovers(node_a.state_dir, timeout=60)
        assert left == [], left
        for s in on_a:
            assert await _state(one, s.id) in ("paused", "failed")
        assert not _nodes(replica.url, admin)[id_a]["healthy"]
        for s in [*on_b, *branches]:
            assert await _state(two, s.id) == "running"
            assert (await s.commands.run("echo still here", timeout=60)).stdout == "still here\n"
        # New sessions go to the node that is left.
        fresh = await AsyncSession.create(timeout=600, client=two)
        assert (await two.get_session(fresh.id)).node_id == id_b
        await fresh.close()
        for s in [*branches, *on_b]:
            await s.close()
        await one.aclose()
        await two.aclose()
    finally:
        codes = {}
        for proc in reversed(started):
            codes[proc.stdout.name] = proc.stop(signal.SIGTERM, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, node_b.errors(), control.errors())
    for state in (workdir / "node-a", workdir / "node-b"):
        left = wait_no_node_leftovers(state, timeout=60)
        assert left == [], left

"""Sessions that outlive their node through the fleet's store (issue 29), with real processes: one
``capsa control`` on PostgreSQL and ``capsa node`` processes with their own state directories, all writing
their snapshots to one store — a real S3 server (Swift with s3api) or a directory.

Proves: a paused session's snapshot is in the store (``stored``), and once the node that took it is gone the
session resumes on another node from the store, with its files and its running processes (a counter that
goes on counting), under the same session id; the first node's stopping leaves nothing of it on the host.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.control.keys import generate_key
from capsa.sdk import AsyncClient, AsyncSession
from tests.support.fleet import enrol_token, listed_nodes, start_control, start_node
from tests.support.leftovers import wait_no_node_leftovers
from tests.support.postgres import PgCluster, postgres_missing_reason, temporary_postgres
from tests.support.s3_server import S3Server
from tests.support.served import Served, serve_workdir

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(1500)]

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done"

if (missing := postgres_missing_reason()) is not None:
    pytest.skip(missing, allow_module_level=True)


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    with temporary_postgres() as cluster:
        yield cluster


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


async def _counter(session: AsyncSession) -> int:
    return int((await session.files.read("/tmp/counter")).strip() or 0)


async def test_a_paused_session_resumes_on_another_node_from_the_store(
        pg: PgCluster, workdir: Path, store_env: dict[str, str]) -> None:
    admin = generate_key().full
    control = start_control(workdir, pg.new_database(), admin)
    started: list[Served] = [control]
    try:
        node_a, id_a = start_node(workdir, "node-a", control.url, enrol_token(control.url, admin), store_env)
        started.append(node_a)
        nodes = listed_nodes(control.url, admin)
        assert str(nodes[id_a]["store"]).startswith(store_env["CAPSA_STORE_URL"])

        client = AsyncClient(control.url, admin)
        session = await AsyncSession.create(timeout=900, client=client)
        assert (await client.get_session(session.id)).node_id == id_a
        await session.files.write("/root/note", "kept on a\n")
        await session.commands.run(COUNTER, background=True)
        await asyncio.sleep(1.5)
        await session.pause()
        [snap] = await client.list_snapshots(session.id)
        assert snap.kind == "pause" and snap.node_id == id_a and snap.stored

        node_b, id_b = start_node(workdir, "node-b", control.url, enrol_token(control.url, admin), store_env)
        started.append(node_b)
        assert node_a.stop(signal.SIGTERM, timeout=120) == 0, node_a.errors()
        started.remove(node_a)
        assert wait_no_node_leftovers(node_a.state_dir, timeout=60) == []

        resumed = await AsyncSession.resume(session.id, client=client)
        assert resumed.id == session.id
        info = await client.get_session(session.id)
        assert info.state == "running" and info.node_id == id_b
        assert await resumed.files.read("/root/note") == "kept on a\n"
        first = await _counter(resumed)
        assert first >= 5  # it counted before the pause and goes on from there, not from zero
        await asyncio.sleep(1.0)
        assert await _counter(resumed) > first
        await resumed.close()
        await client.aclose()
    finally:
        codes = {proc.stdout.name: proc.stop(signal.SIGTERM, timeout=120) for proc in reversed(started)}
    assert all(code == 0 for code in codes.values()), codes
    for name in ("node-a", "node-b"):
        assert wait_no_node_leftovers(workdir / name, timeout=60) == []

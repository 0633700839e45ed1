"""The real node app in-process (httpx.ASGITransport), driven through the control plane's NodeClient.

The agent is the production :class:`NodeAgent` with the fake runtime (real guest daemons as host processes),
so every call takes the whole node path: NodeClient -> HTTP -> node API edge -> agent -> guest channel.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from capsa.common.ids import new_id
from capsa.common.node_api import (
    EXEC_EVENT,
    ExecFinished,
    ExecRequest,
    FileInfo,
    NodeInfo,
    ProcessInfo,
    ProcessStart,
)
from capsa.common.wire.streams import ExecError, ExecOutput
from capsa.control.nodes.client import NodeClient, NodeClientPool, NodeError
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.api.app import create_node_app
from capsa.node.statuses import STATUS
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = pytest.mark.timeout(120)
TOKEN = "node-token-0123456789"
URL = "http://node.test"


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), node_id="n-asgi",
                      capacity=NodeCapacity(memory_mib=2048, vcpus=8, max_sandboxes=4))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.close()


@pytest.fixture
async def client(agent: NodeAgent) -> AsyncIterator[NodeClient]:
    transport = httpx.ASGITransport(app=create_node_app(agent, TOKEN))
    client = NodeClient(URL, TOKEN, transport=transport)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def sandbox(client: NodeClient) -> str:
    sid = new_id("sbx")
    info = await client.create_sandbox(sid, "base", 256, 1, {"SBX": "sandbox-env"})
    assert info.id == sid and info.state == "running"
    return sid


async def _body(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_info_and_sandboxes_are_typed(client: NodeClient, sandbox: str) -> None:
    info = await client.info()
    assert isinstance(info, NodeInfo)
    assert info.node_id == "n-asgi" and "base" in info.templates
    assert info.used["sandboxes"] == 1 and info.capacity["max_sandboxes"] == 4
    assert [s.id for s in await client.list_sandboxes()] == [sandbox]
    await client.destroy_sandbox(sandbox)
    assert await client.list_sandboxes() == []


async def test_exec_result_merges_the_sandbox_env_and_reports_the_exit(client: NodeClient,
                                                                       sandbox: str) -> None:
    result = await client.exec(sandbox, ExecRequest(cmd="echo $SBX $MINE; echo err >&2; exit 3",
                                                    env={"MINE": "cmd-env"}))
    assert (result.stdout, result.stderr, result.exit_code) == ("sandbox-env cmd-env\n", "err\n", 3)
    assert not result.timed_out and not result.stdout_truncated and result.duration_ms > 0
    piped = await client.exec(sandbox, ExecRequest(cmd=["wc", "-c"], stdin="12345"))
    assert piped.stdout.strip() == "5"
    cut = await client.exec(sandbox, ExecRequest(cmd="head -c 5000 /dev/zero | tr '\\0' x", max_output=100))
    assert cut.stdout == "x" * 100 and cut.stdout_truncated


async def test_exec_stream_is_one_typed_event_per_line(client: NodeClient, sandbox: str) -> None:
    # The second byte of the é comes in a later chunk: the node decodes across chunks.
    request = ExecRequest(cmd="printf a; sleep 0.1; printf E >&2; sleep 0.1; printf 'b\\303'; sleep 0.1; "
                              "printf '\\251'; exit 4")
    async with client.exec_stream(sandbox, request) as events:
        got = [event async for event in events]
    assert isinstance(got[-1], ExecFinished) and got[-1].exit_code == 4 and not got[-1].timed_out
    outputs = [e for e in got[:-1] if isinstance(e, ExecOutput)]
    assert len(outputs) == len(got) - 1
    assert "".join(e.data for e in outputs if e.type == "stdout") == "ab\u00e9"  # split UTF-8 joined whole
    assert "".join(e.data for e in outputs if e.type == "stderr") == "E"


async def test_exec_stream_reports_a_failure_in_band(agent: NodeAgent, client: NodeClient,
                                                     sandbox: str) -> None:
    await agent.get(sandbox).sandbox.guest.close()  # the channel breaks after the node accepted the call
    async with client.exec_stream(sandbox, ExecRequest(cmd="echo never")) as events:
        got = [event async for event in events]
    assert len(got) == 1 and isinstance(got[0], ExecError) and got[0].code == "guest_unavailable"


async def test_processes(client: NodeClient, sandbox: str) -> None:
    started = await client.start_process(sandbox, ProcessStart(cmd="echo $SBX; sleep 300"))
    assert isinstance(started, ProcessInfo) and started.running and started.started_at.endswith("+00:00")
    assert started.pid in [p.pid for p in await client.list_processes(sandbox)]
    assert (await client.get_process(sandbox, started.pid)).cmd == ["echo $SBX; sleep 300"]
    for _ in range(100):
        output = await client.process_output(sandbox, started.pid)
        if output.stdout:
            break
    assert output.stdout == "sandbox-env\n" and output.running
    killed = await client.kill_process(sandbox, started.pid, 9)
    assert killed.pid == started.pid
    for _ in range(100):
        done = await client.get_process(sandbox, started.pid)
        if not done.running:
            break
    assert not done.running and done.signal == 9
    with pytest.raises(NodeError) as missing:
        await client.get_process(sandbox, 999_999)
    assert (missing.value.code, missing.value.status) == ("not_found", 404)


async def test_files_and_archives(client: NodeClient, sandbox: str) -> None:
    info = await client.write_file(sandbox, "/tmp/n/a.txt", 0o640, _body(b"hello ", b"node"))
    assert isinstance(info, FileInfo) and (info.size, info.mode, info.type) == (10, 0o640, "file")
    async with client.read_file(sandbox, "/tmp/n/a.txt") as chunks:
        assert b"".join([c async for c in chunks]) == b"hello node"
    assert (await client.stat(sandbox, "/tmp/n/a.txt")).name == "a.txt"
    made = await client.mkdir(sandbox, "/tmp/n/sub/deeper", parents=True)
    assert made.type == "dir"
    assert sorted(f.name for f in await client.list_dir(sandbox, "/tmp/n")) == ["a.txt", "sub"]

    async with client.export_archive(sandbox, "/tmp/n") as chunks:
        tar = b"".join([c async for c in chunks])
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        names = archive.getnames()
    assert any(n.endswith("a.txt") for n in names)
    await client.import_archive(sandbox, "/tmp/copy", _body(tar))
    async with client.read_file(sandbox, "/tmp/copy/a.txt") as chunks:
        assert b"".join([c async for c in chunks]) == b"hello node"

    await client.remove(sandbox, "/tmp/n", recursive=True)
    with pytest.raises(NodeError) as gone:
        await client.stat(sandbox, "/tmp/n")
    assert (gone.value.code, gone.value.status) == ("not_found", 404)
    with pytest.raises(NodeError) as missing:
        async with client.read_file(sandbox, "/tmp/none"):
            pass
    assert (missing.value.code, missing.value.status) == ("not_found", 404)
    with pytest.raises(NodeError) as not_empty:
        await client.mkdir(sandbox, "/tmp/copy/a.txt/x", parents=False)
    assert not_empty.value.status in (404, 409)


async def test_error_codes_and_statuses(agent: NodeAgent, client: NodeClient, sandbox: str) -> None:
    with pytest.raises(NodeError) as unknown:
        await client.exec(new_id("sbx"), ExecRequest(cmd="true"))
    assert (unknown.value.code, unknown.value.status) == ("sandbox_not_found", 404)
    await agent.get(sandbox).sandbox.guest.close()
    with pytest.raises(NodeError) as unavailable:
        await client.exec(sandbox, ExecRequest(cmd="true"))
    assert (unavailable.value.code, unavailable.value.status) == ("guest_unavailable", 503)
    assert STATUS["guest_unavailable"] == 503

    app = create_node_app(agent, TOKEN)
    wrong = NodeClient(URL, "wrong-token-0000000", transport=httpx.ASGITransport(app=app))
    with pytest.raises(NodeError) as unauthorized:
        await wrong.info()
    await wrong.aclose()
    assert (unauthorized.value.code, unauthorized.value.status) == ("unauthorized", 401)


async def test_health_needs_no_token_and_bad_bodies_are_422(agent: NodeAgent) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_node_app(agent, TOKEN)),
                                 base_url=URL) as http:
        health = await http.get("/node/v1/health")
        assert health.json() == {"status": "ok", "node_id": "n-asgi"}
        bad = await http.post(f"/node/v1/sandboxes/{new_id('sbx')}/exec", json={"cmd": []},
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 422 and bad.json()["code"] == "validation_error"


async def test_pool_passes_the_transport_through(agent: NodeAgent) -> None:
    pool = NodeClientPool(transport=httpx.ASGITransport(app=create_node_app(agent, TOKEN)))
    try:
        client = pool.get(URL, TOKEN)
        assert pool.get(URL, TOKEN) is client
        assert (await client.info()).node_id == "n-asgi"
    finally:
        await pool.aclose()


def test_openapi_describes_the_exec_event_stream(agent: NodeAgent) -> None:
    document = create_node_app(agent, TOKEN).openapi()
    schemas = document["components"]["schemas"]
    assert set(schemas["ExecEvent"]["discriminator"]["mapping"]) == {"stdout", "stderr", "result", "error"}
    content = document["paths"]["/node/v1/sandboxes/{sandbox_id}/exec"]["post"]["responses"]["200"]["content"]
    assert content["application/x-ndjson"]["schema"] == {"$ref": "#/components/schemas/ExecEvent"}
    parsed = EXEC_EVENT.validate_json('{"type":"error","code":"x","detail":"y"}')
    assert parsed == ExecError(code="x", detail="y")

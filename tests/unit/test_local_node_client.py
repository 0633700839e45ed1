"""``capsa serve``'s in-process node calls (capsa.local_node): a command run to its end and a sandbox
creation answer exactly what the same node answers over its Unix socket, errors included (code and
status), with the fake runtime's real guest daemons."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from capsa.common.ids import new_id
from capsa.common.node_api import ExecRequest
from capsa.control.nodeclient import NodeClient, NodeClientPool, NodeError
from capsa.local_node import LocalNodeClient
from capsa.node.agent import NodeAgent, NodeCapacity
from capsa.node.api import create_node_app
from tests.support.api_stack import serve_app
from tests.support.fake_runtime import FakeRuntime, fake_image

TOKEN = "node-token-local-0123456789"


@pytest.fixture
async def both(tmp_path: Path) -> AsyncIterator[tuple[NodeClient, LocalNodeClient]]:
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), node_id="n-local",
                      capacity=NodeCapacity(memory_mib=4096, vcpus=8, max_sandboxes=4))
    await agent.start()
    sock_dir = Path(tempfile.mkdtemp(prefix="capsa-local-node-"))
    served = await serve_app(create_node_app(agent, TOKEN), uds=str(sock_dir / "node.sock"), lifespan="off")
    remote = NodeClient(served.url, TOKEN)
    local = LocalNodeClient(served.url, TOKEN, agent)
    try:
        yield remote, local
    finally:
        await remote.aclose()
        await local.aclose()
        await served.stop()
        await agent.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


async def _error(call: object) -> tuple[str, int]:
    with pytest.raises(NodeError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code, caught.value.status


async def test_the_same_answers_in_process_and_over_the_socket(
        both: tuple[NodeClient, LocalNodeClient]) -> None:
    remote, local = both
    sid = new_id("sbx")
    made = await local.create_sandbox(sid, "base", 256, 1, {"FROM": "local"})
    assert made.id == sid and made.memory_mib == 256
    # The node knows it: the socket API lists what the in-process call made.
    assert made.id in {s.id for s in await remote.list_sandboxes()}
    request = ExecRequest(cmd="echo $FROM; echo err >&2; exit 3", timeout=30)
    here, there = await local.exec(made.id, request), await remote.exec(made.id, request)
    fields = ("exit_code", "signal", "stdout", "stderr", "timed_out", "stdout_truncated", "oom_killed")
    assert [getattr(here, f) for f in fields] == [getattr(there, f) for f in fields]
    assert (here.exit_code, here.stdout, here.stderr) == (3, "local\n", "err\n")
    with_stdin = await local.exec(made.id, ExecRequest(cmd=["cat"], stdin="fed", timeout=30))
    assert with_stdin.stdout == "fed"
    await remote.destroy_sandbox(made.id)


async def test_errors_keep_the_node_apis_codes_and_statuses(both: tuple[NodeClient, LocalNodeClient]) -> None:
    remote, local = both
    request = ExecRequest(cmd=["true"], timeout=30)
    gone = new_id("sbx")
    assert await _error(local.exec(gone, request)) == await _error(remote.exec(gone, request))
    assert (await _error(local.exec(gone, request)))[1] == 404
    for args in ((new_id("sbx"), "no-such-template", 256, 1, {}),
                 (new_id("sbx"), "base", 10, 1, {}),     # below the smallest memory
                 ("not an id", "base", 256, 1, {})):
        assert await _error(local.create_sandbox(*args)) == await _error(remote.create_sandbox(*args)), args
    made = await local.create_sandbox(new_id("sbx"), "base", 256, 1, {})
    missing = ExecRequest(cmd=["/no/such/program"], timeout=30)
    assert await _error(local.exec(made.id, missing)) == await _error(remote.exec(made.id, missing))
    await remote.destroy_sandbox(made.id)


async def test_the_pool_hands_out_the_local_client_for_its_node() -> None:
    pool = NodeClientPool()
    first = pool.get("unix:///tmp/nowhere.sock", TOKEN)

    class _Stub(NodeClient):
        pass

    stub = _Stub("unix:///tmp/nowhere.sock", TOKEN)
    pool.add(stub)
    assert pool.get("unix:///tmp/nowhere.sock", TOKEN) is stub
    assert pool.get("unix:///tmp/nowhere.sock", "another-token") is not stub
    await pool.aclose()
    assert first._client.is_closed and stub._client.is_closed

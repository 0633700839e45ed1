"""``capsa serve``'s seam to its own node: the same :class:`NodeClient` with the node's app in-process. Whole
answers (a command run to its end, a sandbox creation ...) come from the app without touching the node's
socket, and answer exactly what the same node answers over its Unix socket, errors included (code and
status), with the fake runtime's real guest daemons; streamed answers still go over the socket."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi import FastAPI

from capsa.common.ids import new_id
from capsa.common.node_api import ExecFinished, ExecRequest
from capsa.control.nodes.client import NodeClient, NodeClientPool, NodeError
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.api.app import create_node_app
from tests.support.api_stack import Replica, serve_app
from tests.support.fake_runtime import FakeRuntime, fake_image

TOKEN = "node-token-local-0123456789"


@dataclass
class Node:
    agent: NodeAgent
    app: FastAPI
    served: Replica
    remote: NodeClient
    """Over the node's Unix socket."""
    local: NodeClient
    """The same node's app in-process (streams over the socket)."""


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), node_id="n-local",
                      capacity=NodeCapacity(memory_mib=4096, vcpus=8, max_sandboxes=4))
    await agent.start()
    sock_dir = Path(tempfile.mkdtemp(prefix="capsa-local-node-"))
    app = create_node_app(agent, TOKEN)
    served = await serve_app(app, uds=str(sock_dir / "node.sock"), lifespan="off")
    remote = NodeClient(served.url, TOKEN)
    local = NodeClient(served.url, TOKEN, app=app)
    try:
        yield Node(agent, app, served, remote, local)
    finally:
        await remote.aclose()
        await local.aclose()
        if not served.task.done():
            await served.stop()
        await agent.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


async def _error(call: object) -> tuple[str, int]:
    with pytest.raises(NodeError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code, caught.value.status


async def test_the_same_answers_in_process_and_over_the_socket(node: Node) -> None:
    remote, local = node.remote, node.local
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


async def test_errors_keep_the_node_apis_codes_and_statuses(node: Node) -> None:
    remote, local = node.remote, node.local
    request = ExecRequest(cmd=["true"], timeout=30)
    gone = new_id("sbx")
    args: tuple[str, str, int, int, dict[str, str]]
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


async def test_whole_answers_skip_the_socket_and_streams_use_it(node: Node) -> None:
    local = node.local
    made = await local.create_sandbox(new_id("sbx"), "base", 256, 1, {})
    request = ExecRequest(cmd="echo streamed", timeout=30)
    async with local.exec_stream(made.id, request) as events:  # over the socket, event by event
        finished = [e async for e in events if isinstance(e, ExecFinished)]
    assert len(finished) == 1 and finished[0].exit_code == 0
    await node.served.stop()  # the socket is gone: only the in-process app answers now
    assert (await local.exec(made.id, ExecRequest(cmd="echo here", timeout=30))).stdout == "here\n"
    again = await local.create_sandbox(new_id("sbx"), "base", 256, 1, {})
    assert {s.id for s in await local.list_sandboxes()} == {made.id, again.id}
    with pytest.raises(NodeError) as caught:
        async with local.exec_stream(made.id, request):
            pass
    assert (caught.value.code, caught.value.status) == ("node_unreachable", 503)


async def test_an_unexpected_error_or_a_slow_node_answers_as_over_http(node: Node,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> list[object]:
        raise RuntimeError("boom")

    monkeypatch.setattr(node.agent, "list", broken)
    assert await _error(node.local.list_sandboxes()) == await _error(node.remote.list_sandboxes()) \
        == ("internal_error", 500)

    async def slow(sandbox_id: str) -> None:
        await asyncio.sleep(30)

    monkeypatch.setattr(node.agent, "destroy", slow)
    impatient = NodeClient(node.served.url, TOKEN, app=node.app, timeout=0.5)
    try:
        assert await _error(impatient.destroy_sandbox(new_id("sbx"))) == ("node_unreachable", 503)
    finally:
        await impatient.aclose()


async def test_the_pool_hands_out_the_in_process_client_for_its_node(node: Node) -> None:
    pool = NodeClientPool()
    first = pool.get("unix:///tmp/nowhere.sock", TOKEN)
    local = NodeClient("unix:///tmp/nowhere.sock", TOKEN, app=node.app)
    pool.add(local)
    assert pool.get("unix:///tmp/nowhere.sock", TOKEN) is local
    assert pool.get("unix:///tmp/nowhere.sock", "another-token") is not local
    await pool.aclose()
    assert first._client.is_closed and local._client.is_closed

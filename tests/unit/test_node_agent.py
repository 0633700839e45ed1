"""The node agent and its HTTP API, over a Unix socket, with guest daemons as confined host processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.common.ids import new_id
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.api.app import create_node_app
from tests.support.api_stack import Replica, serve_app
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.waits import eventually

pytestmark = pytest.mark.timeout(120)
TOKEN = "node-token-0123456789"


class Node:
    def __init__(self, agent: NodeAgent, runtime: FakeRuntime, server: Replica) -> None:
        self.agent, self.runtime, self.server = agent, runtime, server
        assert server.url.startswith("unix://")
        self.socket = server.url.removeprefix("unix://")

    def client(self, token: str | None = TOKEN) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url="http://node/node/v1",
            headers=headers,
            timeout=60,
        )


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    runtime = FakeRuntime()
    agent = NodeAgent(
        runtime,
        fake_image(tmp_path / "img"),
        node_id="n1",
        capacity=NodeCapacity(memory_mib=1024, vcpus=4, max_sandboxes=2),
    )
    await agent.start()
    server = await serve_app(create_node_app(agent, TOKEN), uds=str(tmp_path / "node.sock"), lifespan="off")
    try:
        yield Node(agent, runtime, server)
    finally:
        await server.stop()
        await agent.close()


async def _create(client: httpx.AsyncClient, **extra: Any) -> str:
    sid = new_id("sbx")
    response = await client.post("/sandboxes", json={"id": sid, **extra})
    assert response.status_code == 201, response.text
    return sid


def _code(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["code"] == code


async def test_token_is_required(node: Node) -> None:
    async with node.client(None) as anon, node.client("wrong-token-xxxxxxxxxx") as wrong:
        assert (await anon.get("/health")).status_code == 200
        _code(await anon.get("/info"), 401, "unauthorized")
        _code(await wrong.get("/sandboxes"), 401, "unauthorized")
        _code(await wrong.post("/sandboxes", json={"id": new_id("sbx")}), 401, "unauthorized")
    assert node.runtime.boots == 0
    with pytest.raises(ValueError):
        create_node_app(node.agent, "short")


async def test_orphans_are_removed_on_start(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    stale = runtime.base_dir / "sbx_leftoverfromcrash0000"
    stale.mkdir()
    (stale / "disk").write_bytes(b"x")
    agent = NodeAgent(runtime, fake_image(tmp_path / "img"))
    assert await agent.start() == ["sbx_leftoverfromcrash0000"]
    assert not stale.exists()
    await agent.close()


async def test_capacity_env_exec_and_destroy(node: Node) -> None:
    async with node.client() as c:
        a = await _create(c, env={"FROM_SESSION": "yes"}, memory_mib=512)
        _code(await c.post("/sandboxes", json={"id": a}), 409, "already_exists")
        _code(await c.post("/sandboxes", json={"id": new_id("sbx"), "memory_mib": 1024}), 503, "no_capacity")
        _code(
            await c.post("/sandboxes", json={"id": new_id("sbx"), "template": "gpu"}),
            404,
            "template_not_found",
        )
        _code(await c.post("/sandboxes", json={"id": "not-an-id"}), 422, "validation_error")
        b = await _create(c)
        _code(await c.post("/sandboxes", json={"id": new_id("sbx")}), 503, "no_capacity")  # max_sandboxes
        info = (await c.get("/info")).json()
        assert info["used"] == {"memory_mib": 768, "vcpus": 2, "sandboxes": 2}
        assert info["capacity"] == {"memory_mib": 1024, "vcpus": 4, "max_sandboxes": 2}

        ran = (
            await c.post(f"/sandboxes/{a}/exec", json={"cmd": "echo $FROM_SESSION $X", "env": {"X": "1"}})
        ).json()
        assert ran["stdout"] == "yes 1\n" and ran["exit_code"] == 0

        assert (await c.delete(f"/sandboxes/{b}")).status_code == 204
        assert (await c.delete(f"/sandboxes/{b}")).status_code == 204  # idempotent
        _code(await c.post(f"/sandboxes/{b}/exec", json={"cmd": "true"}), 404, "sandbox_not_found")
        assert [s["id"] for s in (await c.get("/sandboxes")).json()["items"]] == [a]


async def test_ndjson_stream_decodes_split_utf8_and_cancels_on_disconnect(node: Node) -> None:
    async with node.client() as c:
        sid = await _create(c)
        # "é" is two bytes; printing them in separate writes splits them across output chunks.
        cmd = r"printf '\303'; sleep 0.2; printf '\251\n'"
        async with c.stream(
            "POST", f"/sandboxes/{sid}/exec", json={"cmd": cmd}, headers={"Accept": "application/x-ndjson"}
        ) as response:
            events = [json.loads(line) async for line in response.aiter_lines() if line]
        assert "".join(e["data"] for e in events if e["type"] == "stdout") == "é\n"
        assert events[-1]["type"] == "result" and events[-1]["exit_code"] == 0

        async with c.stream(
            "POST",
            f"/sandboxes/{sid}/exec",
            json={"cmd": "echo go; exec sleep 77"},
            headers={"Accept": "application/x-ndjson"},
        ) as response:
            async for line in response.aiter_lines():
                if line:
                    break  # the client goes away while the command runs
        for _ in range(50):
            ps = (await c.post(f"/sandboxes/{sid}/exec", json={"cmd": "ps -eo args"})).json()["stdout"]
            if "sleep 77" not in ps:
                break
            await asyncio.sleep(0.1)
        assert "sleep 77" not in ps


async def test_dead_sandbox_is_reported(node: Node) -> None:
    async with node.client() as c:
        sid = await _create(c)
        (sandbox,) = node.runtime.list()
        import os

        os.kill(sandbox.pid, 9)  # type: ignore[attr-defined]

        async def failed() -> list[str]:
            listed: list[str] = (await c.get("/info")).json()["failed_sandboxes"]
            return listed

        # The node's watcher notices the death and reports it (bounded: it takes a moment).
        assert await eventually(failed, "the killed sandbox reported failed", within=10) == [sid]
        _code(await c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}), 409, "sandbox_failed")
        assert (await c.delete(f"/sandboxes/{sid}")).status_code == 204
        assert (await c.get("/info")).json()["failed_sandboxes"] == []


async def test_destroy_while_booting_wins(node: Node) -> None:
    sid = new_id("sbx")
    create = asyncio.create_task(node.agent.create(sid, "base", 256, 1, {}))
    await asyncio.sleep(0)  # the boot has started
    assert await node.agent.destroy(sid) is True
    with pytest.raises(Exception, match="destroyed while it was created"):
        await create
    assert node.agent.list() == [] and node.runtime.list() == []


async def test_control_plane_node_client_over_tcp(tmp_path: Path) -> None:
    from capsa.common.node_api import ExecRequest
    from capsa.control.nodes.client import NodeClient, NodeError

    runtime = FakeRuntime()
    agent = NodeAgent(runtime, fake_image(tmp_path / "img"))
    server = await serve_app(create_node_app(agent, TOKEN), lifespan="off")
    assert server.url.startswith("http://127.0.0.1:")
    client = NodeClient(server.url, TOKEN)
    try:
        assert (await client.info()).templates == ["base"]
        sid = new_id("sbx")
        await client.create_sandbox(sid, "base", 256, 1, {"A": "1"})
        assert (await client.exec(sid, ExecRequest(cmd="echo $A"))).stdout == "1\n"

        async def body() -> AsyncIterator[bytes]:
            yield b"hello "
            yield b"node"

        info = await client.write_file(sid, "/tmp/h", 0o640, body())
        assert info.size == 10 and info.mode == 0o640
        async with client.read_file(sid, "/tmp/h") as chunks:
            assert b"".join([c async for c in chunks]) == b"hello node"
        with pytest.raises(NodeError) as missing:
            async with client.read_file(sid, "/tmp/none") as chunks:
                pass
        assert missing.value.code == "not_found" and missing.value.status == 404
        await client.destroy_sandbox(sid)
        with pytest.raises(NodeError) as gone:
            await client.exec(sid, ExecRequest(cmd="true"))
        assert gone.value.code == "sandbox_not_found"
        wrong = NodeClient(server.url, "wrong-token-0000000")
        with pytest.raises(NodeError) as unauthorized:
            await wrong.info()
        await wrong.aclose()
        assert unauthorized.value.code == "unauthorized"
    finally:
        await client.aclose()
        await server.stop()
        await agent.close()
    stale = NodeClient(server.url, TOKEN)
    with pytest.raises(NodeError) as unreachable:
        await stale.info()
    await stale.aclose()
    assert unreachable.value.code == "node_unreachable"

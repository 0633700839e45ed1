"""``NodeService`` with ``HttpControlLink``, the pieces ``capsa node`` runs, against a real control plane over
HTTP: enrolment with a one-time token, the credential kept 0600 in the state dir, heartbeats, leave on stop,
re-registration with the stored credential after a restart, and the errors a mis-started node gets."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.assembly import NodeParts
from capsa.node.daemon import IDENTITY_FILE, ControlLinkError, HttpControlLink, NodeService
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgresql]


async def _agent(tmp_path: Path) -> NodeAgent:
    agent = NodeAgent(FakeRuntime(), fake_image(tmp_path / "img"), node_id="unregistered",
                      capacity=NodeCapacity(memory_mib=1024, vcpus=4, max_sandboxes=4))
    await agent.start()
    return agent


async def _service(tmp_path: Path, control_url: str, state: Path, token: str | None,
                   **kwargs: float) -> NodeService:
    link = HttpControlLink(control_url, state, enrol_token=token)
    return NodeService(NodeParts(await _agent(tmp_path)), link, listen="127.0.0.1:0", **kwargs)


async def _token(stack: ApiStack) -> str:
    async with stack.client(stack.admin_key) as admin:
        made = await admin.post("/v1/nodes/tokens", json={})
        assert made.status_code == 201, made.text
        return str(made.json()["token"])


async def _node(stack: ApiStack, node_id: str) -> dict[str, object]:
    async with stack.client(stack.admin_key) as admin:
        listed = (await admin.get("/v1/nodes")).json()["items"]
    found = [n for n in listed if n["id"] == node_id]
    assert len(found) == 1, listed
    return dict(found[0])


@pytest.fixture
async def state(tmp_path: Path) -> AsyncIterator[Path]:
    path = tmp_path / "node-state"
    path.mkdir()
    yield path


async def test_enrol_heartbeat_leave_and_reregister(stack: ApiStack, state: Path, tmp_path: Path) -> None:
    token = await _token(stack)
    service = await _service(tmp_path, stack.url, state, token, heartbeat_interval=0.2)
    try:
        node_id = await service.start()
        assert node_id.startswith("node_") and service.parts.agent.node_id == node_id
        identity = state / IDENTITY_FILE
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600
        stored = json.loads(identity.read_text())
        assert stored["id"] == node_id and stored["credential"] and token not in identity.read_text()
        info = await _node(stack, node_id)
        assert info["healthy"] is True and info["url"] == service.url and not str(info["url"]).endswith(":0")
        first = info["last_heartbeat_at"]
        for _ in range(50):  # heartbeats every 0.2 s
            await asyncio.sleep(0.1)
            if (await _node(stack, node_id))["last_heartbeat_at"] != first:
                break
        else:
            raise AssertionError("no heartbeat arrived")
    finally:
        await service.stop()
    left = await _node(stack, node_id)
    assert left["healthy"] is False and left["left_at"] is not None

    # A restart needs no token: the stored credential re-registers the same node.
    again = await _service(tmp_path, stack.url, state, None)
    try:
        assert await again.start() == node_id
        back = await _node(stack, node_id)
        assert back["healthy"] is True and back["left_at"] is None and back["url"] == again.url
    finally:
        await again.stop()


async def test_a_node_without_identity_needs_a_valid_token(stack: ApiStack, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ControlLinkError) as missing:
        HttpControlLink(stack.url, fresh, enrol_token=None)
    assert missing.value.code == "enrol_token_required"

    token = await _token(stack)
    first = await _service(tmp_path, stack.url, fresh, token)
    try:
        await first.start()
    finally:
        await first.stop()
    other = tmp_path / "other"
    other.mkdir()
    reused = await _service(tmp_path, stack.url, other, token)
    try:
        with pytest.raises(ControlLinkError) as refused:
            await reused.start()
        assert refused.value.code == "enrol_token_invalid" and refused.value.status == 401
        assert not (other / IDENTITY_FILE).exists()
    finally:
        await reused.stop()


async def test_unreachable_control_plane_is_a_clear_error(tmp_path: Path, state: Path) -> None:
    service = await _service(tmp_path, "http://127.0.0.1:9", state, "cne_x")
    try:
        with pytest.raises(ControlLinkError) as failed:
            await service.start()
        assert failed.value.code == "control_unreachable" and "127.0.0.1:9" in failed.value.message
    finally:
        await service.stop()

"""Nodes as separate processes, control-plane side: enrolment tokens, enrol, register, heartbeat, leave, the
node secrets at rest, and placement over several nodes (real app in-process, SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text, update

from capsa.control.errors import NoCapacity, TemplateNotFound
from capsa.control.nodes.placement import choose_node, choose_snapshot_node
from capsa.control.nodes.registry import fail_silent_nodes
from capsa.control.plane import ControlPlane
from capsa.control.store.models import (
    NodeEnrolTokenRow,
    NodeRow,
    SessionMetadataRow,
    SessionRow,
    SnapshotRow,
    utcnow,
)
from capsa.node.agent.capacity import NodeCapacity
from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.postgresql

MakeStack = Callable[..., Awaitable[ApiStack]]
API_TOKEN = "node-api-token-" + "a" * 24


def enrol_body(url: str = "http://127.0.0.1:9", *, egress: bool = False, memory: int = 4096,
               templates: tuple[str, ...] = ("base",), name: str | None = "n1",
               store: str | None = None) -> dict[str, Any]:
    return {"url": url, "api_token": API_TOKEN, "egress": egress, "name": name, "templates": list(templates),
            "capacity": {"memory_mib": memory, "vcpus": 8, "max_sandboxes": 4}, "store": store}


def plane_of(stack: ApiStack) -> ControlPlane:
    plane = stack.replicas[0].app.state.plane
    assert isinstance(plane, ControlPlane)
    return plane


async def new_token(stack: ApiStack, **body: Any) -> str:
    async with stack.client(stack.admin_key) as admin:
        answer = await admin.post("/v1/nodes/tokens", json=body)
    assert answer.status_code == 201, answer.text
    assert answer.json()["expires_at"]
    return str(answer.json()["token"])


async def enrol(stack: ApiStack, token: str, url: str | None = None, **body: Any) -> dict[str, Any]:
    async with stack.client(token, url=url) as node:
        answer = await node.post("/v1/nodes/enrol", json=enrol_body(**body))
    assert answer.status_code == 201, answer.text
    data: dict[str, Any] = answer.json()
    return data


def assert_problem(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["code"] == code


async def test_enrol_register_heartbeat_leave(stack: ApiStack) -> None:
    token = await new_token(stack)
    node = await enrol(stack, token)
    node_id, credential = node["id"], node["credential"]
    assert node_id.startswith("node_") and credential
    async with stack.client(credential) as client:
        beat = await client.post(f"/v1/nodes/{node_id}/heartbeat", json={"used": {"sandboxes": 0},
                                                                      "templates": ["base", "py"]})
        assert beat.status_code == 200, beat.text
        assert beat.json()["healthy"] is True and beat.json()["templates"] == ["base", "py"]
        assert beat.json()["destroy_sandboxes"] == []
        moved = await client.post(f"/v1/nodes/{node_id}/register", json={
            "url": "http://127.0.0.1:10", "api_token": "another-token-" + "b" * 20, "egress": True,
            "capacity": {"memory_mib": 8192, "vcpus": 4, "max_sandboxes": 2}, "templates": ["base"]})
        assert moved.status_code == 200, moved.text
        assert moved.json()["url"] == "http://127.0.0.1:10" and moved.json()["egress"] is True
        # The node's own registration cannot raise its capacity above what it enrolled with.
        assert moved.json()["capacity"] == {"memory_mib": 4096, "vcpus": 4, "max_sandboxes": 2}
        assert moved.json()["capacity_limit"] == {"memory_mib": 4096, "vcpus": 8, "max_sandboxes": 4}
        left = await client.post(f"/v1/nodes/{node_id}/leave")
        assert left.status_code == 200, left.text
        assert left.json()["healthy"] is False and left.json()["left_at"] is not None
    async with stack.client(stack.admin_key) as admin:
        listed = {n["id"]: n for n in (await admin.get("/v1/nodes")).json()["items"]}
        assert listed[node_id]["healthy"] is False and listed[node_id]["name"] == "n1"
        assert listed[stack.node_id]["healthy"] is True
        # An admin key is still accepted for a node's own routes, and registering again ends the leave.
        again = {k: v for k, v in enrol_body().items() if k != "name"}
        back = await admin.post(f"/v1/nodes/{node_id}/register", json=again)
        assert back.status_code == 200, back.text
        assert back.json()["healthy"] is True and back.json()["left_at"] is None


async def test_enrol_token_is_single_use_and_expires(stack: ApiStack) -> None:
    token = await new_token(stack, ttl_seconds=60)
    await enrol(stack, token)
    async with stack.client(token) as node:
        assert_problem(await node.post("/v1/nodes/enrol", json=enrol_body()), 401, "enrol_token_invalid")
    expired = await new_token(stack)
    async with plane_of(stack).db() as db:
        await db.execute(update(NodeEnrolTokenRow).where(
            NodeEnrolTokenRow.token_hash == hashlib.sha256(expired.encode()).hexdigest())
            .values(expires_at=utcnow() - timedelta(seconds=1)))
        await db.commit()
    for bad in (expired, "cne_" + "x" * 43, None):
        async with stack.client(bad) as node:
            assert_problem(await node.post("/v1/nodes/enrol", json=enrol_body()), 401, "enrol_token_invalid")
    async with stack.client(stack.admin_key) as admin:
        assert (await admin.post("/v1/nodes/tokens", json={"ttl_seconds": 10})).status_code == 422
    user = await stack.tenant_key("t1")
    async with stack.client(user) as client:
        assert_problem(await client.post("/v1/nodes/tokens", json={}), 403, "forbidden")


async def test_two_replicas_race_for_one_token_and_exactly_one_wins(stack: ApiStack) -> None:
    second = await stack.add_replica()
    for _ in range(5):
        token = await new_token(stack)
        async with stack.client(token) as one, stack.client(token, url=second.url) as two:
            answers = await asyncio.gather(one.post("/v1/nodes/enrol", json=enrol_body()),
                                           two.post("/v1/nodes/enrol", json=enrol_body()))
        assert sorted(a.status_code for a in answers) == [201, 401], [a.text for a in answers]
    async with plane_of(stack).db() as db:
        enrolled = list((await db.execute(select(NodeRow.id).where(NodeRow.id.like("node\\_%", escape="\\"))))
                        .scalars())
        used = [n for n in (await db.execute(select(NodeEnrolTokenRow.node_id))).scalars() if n is not None]
    assert len(enrolled) == 5 and sorted(enrolled) == sorted(used)


async def test_wrong_node_credentials_are_refused(stack: ApiStack) -> None:
    first = await enrol(stack, await new_token(stack))
    other = await enrol(stack, await new_token(stack))
    route = f"/v1/nodes/{first['id']}"
    for bad in ("cnc_wrong", other["credential"], API_TOKEN):
        async with stack.client(bad) as client:
            assert_problem(await client.post(f"{route}/heartbeat", json={}), 401, "unauthorized")
            assert_problem(await client.post(f"{route}/leave"), 401, "unauthorized")
            assert_problem(await client.post(f"{route}/register", json=enrol_body()), 401, "unauthorized")
    async with stack.client(None) as anonymous:
        assert_problem(await anonymous.post(f"{route}/heartbeat", json={}), 401, "unauthorized")
    async with stack.client(first["credential"]) as client:
        assert_problem(await client.post("/v1/nodes/node_ghost/heartbeat", json={}), 401, "unauthorized")


async def test_node_secrets_are_not_stored_in_clear(stack: ApiStack) -> None:
    node = await enrol(stack, await new_token(stack))
    async with plane_of(stack).db() as db:
        row = await db.get(NodeRow, node["id"])
        assert row is not None and row.token_sealed is not None
        assert API_TOKEN.encode() not in row.token_sealed
        assert row.credential_hash == hashlib.sha256(node["credential"].encode()).hexdigest()
        raw = (await db.execute(text("SELECT * FROM nodes"))).all()
        tokens = (await db.execute(text("SELECT * FROM node_enrol_tokens"))).all()
    dump = repr(raw) + repr(tokens)
    for secret in (API_TOKEN, node["credential"], stack.node_token):
        assert secret not in dump
    # The control plane still presents the right token when it calls the node.
    sealer = plane_of(stack).sealer
    assert sealer is not None
    assert sealer.open(node["id"], row.token_sealed) == API_TOKEN


async def test_leave_fails_sessions_without_snapshot_and_stops_placement(stack: ApiStack) -> None:
    user = await stack.tenant_key("t1")
    async with stack.client(user) as client:
        created = await client.post("/v1/sessions", json={"template": "base"})
        assert created.status_code == 201, created.text
        session = created.json()
        assert session["node_id"] == stack.node_id
        async with stack.client(stack.node_token) as node:
            assert (await node.post(f"/v1/nodes/{stack.node_id}/leave")).status_code == 200
        after = (await client.get(f"/v1/sessions/{session['id']}")).json()
        assert after["state"] == "failed" and after["failure_reason"] == "node_lost"
        assert_problem(await client.post("/v1/sessions", json={"template": "base"}), 503, "no_capacity")


@pytest.mark.parametrize("first", ["leave call", "reaper"])
async def test_a_stopping_nodes_sessions_end_the_same_whichever_path_comes_first(stack: ApiStack,
                                                                                first: str) -> None:
    """A stopping node's leave call and the reaper (which sees the node's ``left_at``) race for its sessions:
    either one must leave the same states and reasons behind."""
    plane = plane_of(stack)
    user = await stack.tenant_key("t1")
    async with stack.client(user) as client:
        bare = (await client.post("/v1/sessions", json={"template": "base"})).json()
        kept = (await client.post("/v1/sessions", json={"template": "base"})).json()
        assert (await client.post(f"/v1/sessions/{kept['id']}/snapshots")).status_code == 201
        if first == "leave call":
            async with stack.client(stack.node_token) as node:
                assert (await node.post(f"/v1/nodes/{stack.node_id}/leave")).status_code == 200
        else:
            async with plane.db() as db:
                await db.execute(update(NodeRow).where(NodeRow.id == stack.node_id).values(left_at=utcnow()))
                await db.commit()
            assert await fail_silent_nodes(plane) == [bare["id"]]
        failed = (await client.get(f"/v1/sessions/{bare['id']}")).json()
        paused = (await client.get(f"/v1/sessions/{kept['id']}")).json()
    assert (failed["state"], failed["failure_reason"]) == ("failed", "node_lost")
    assert paused["state"] == "paused" and paused["pause_reason"].startswith("sandbox lost (node stopped); ")


async def _choose(plane: ControlPlane, memory: int = 256, egress: bool = False,
                  template: str = "base") -> str:
    async with plane.db() as db:
        return (await choose_node(db, template, memory, 1, plane.settings.node_heartbeat_timeout,
                                  egress=egress)).id


async def test_placement_by_egress_capacity_and_health(stack: ApiStack) -> None:
    plane = plane_of(stack)
    async with stack.client(stack.admin_key) as admin:  # take the stack's own node out of the picture
        assert (await admin.post(f"/v1/nodes/{stack.node_id}/leave")).status_code == 200
    plain = await enrol(stack, await new_token(stack), memory=16384, egress=False)
    networked = await enrol(stack, await new_token(stack), memory=2048, egress=True)
    assert await _choose(plane) == plain["id"]  # most free memory wins
    assert await _choose(plane, egress=True) == networked["id"]  # only it can run an egress policy
    assert await _choose(plane, memory=8192) == plain["id"]
    with pytest.raises(NoCapacity, match="no node has room"):
        await _choose(plane, memory=4096, egress=True)  # the egress node is too small: no room
    with pytest.raises(TemplateNotFound):
        await _choose(plane, template="nope")
    async with plane.db() as db:  # the big node falls silent
        await db.execute(update(NodeRow).where(NodeRow.id == plain["id"])
                         .values(last_heartbeat_at=utcnow() - timedelta(hours=1)))
        await db.commit()
    assert await _choose(plane) == networked["id"]
    async with stack.client(networked["credential"]) as node:
        assert (await node.post(f"/v1/nodes/{networked['id']}/leave")).status_code == 200
    with pytest.raises(NoCapacity, match="no healthy node"):
        await _choose(plane)


async def test_a_session_with_a_policy_needs_an_egress_node(make_stack: MakeStack) -> None:
    import base64
    import os

    s = await make_stack(settings={"secret_key": base64.b64encode(os.urandom(32)).decode()})
    async with s.client(s.admin_key) as admin:  # the stack's node, registered again without egress
        body = {"id": s.node_id, "url": "http://127.0.0.1:9", "token": s.node_token, "egress": False,
                "capacity": {"memory_mib": 8192, "vcpus": 32, "max_sandboxes": 16}}
        assert (await admin.post("/v1/nodes", json=body)).status_code == 201
    user = await s.tenant_key("t1")
    async with s.client(user) as client:
        policy = {"domains": [{"domain": "api.example.com"}]}
        answer = await client.post("/v1/sessions", json={"template": "base", "policy": policy})
    assert_problem(answer, 503, "no_capacity")
    assert "networked" in answer.json()["detail"]


async def test_snapshot_placement_prefers_its_node_then_nodes_of_the_same_store(stack: ApiStack) -> None:
    plane = plane_of(stack)
    user = await stack.tenant_key("t1")
    async with stack.client(user) as client:
        created = await client.post("/v1/sessions", json={"template": "base"})
        assert created.status_code == 201, created.text
    async with stack.client(stack.admin_key) as admin:  # take the stack's own node out of the picture
        assert (await admin.post(f"/v1/nodes/{stack.node_id}/leave")).status_code == 200
    holder = await enrol(stack, await new_token(stack), memory=2048, store="s3://fleet/a")
    same = await enrol(stack, await new_token(stack), memory=4096, store="s3://fleet/a")
    other = await enrol(stack, await new_token(stack), memory=16384, store="s3://elsewhere/b")
    local = await enrol(stack, await new_token(stack), memory=16384)
    snap = SnapshotRow(id="snap_" + "a" * 20, tenant="t1", session_id=created.json()["id"],
                       node_id=holder["id"], kind="pause", created_at=utcnow(), stored=True)

    async def choose() -> str:
        async with plane.db() as db:
            return (await choose_snapshot_node(db, snap, 256, 1, plane.settings.node_heartbeat_timeout)).id

    async def set_node(node_id: str, **values: Any) -> None:
        async with plane.db() as db:
            await db.execute(update(NodeRow).where(NodeRow.id == node_id).values(**values))
            await db.commit()

    assert await choose() == holder["id"]  # it holds the snapshot: no transfer
    await set_node(holder["id"], last_heartbeat_at=utcnow() - timedelta(hours=1))
    assert await choose() == same["id"]  # it reads the same store; the bigger nodes do not
    snap.stored = False  # the push failed: only the holder has it
    with pytest.raises(NoCapacity, match="holds the snapshot"):
        await choose()
    snap.stored = True
    await set_node(same["id"], draining=True)  # a draining node takes nothing new
    with pytest.raises(NoCapacity, match="no other healthy node reads the store"):
        await choose()
    assert other["id"] and local["id"]


async def test_a_lost_nodes_session_without_a_snapshot_fails_as_node_lost(stack: ApiStack) -> None:
    plane = plane_of(stack)
    user = await stack.tenant_key("t1")
    async with stack.client(user) as client:
        created = await client.post("/v1/sessions", json={"template": "base"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        async with plane.db() as db:
            await db.execute(update(NodeRow).where(NodeRow.id == stack.node_id)
                             .values(last_heartbeat_at=utcnow() - timedelta(hours=2)))
            await db.commit()
        assert await fail_silent_nodes(plane) == [sid]
        after = (await client.get(f"/v1/sessions/{sid}")).json()
        assert after["state"] == "failed" and after["failure_reason"] == "node_lost"
        events = (await client.get("/v1/audit", params={"session_id": sid})).json()["items"]
        assert any(e["action"] == "fail" and e["detail"]["reason"] == "node_lost" for e in events), events


async def test_a_node_short_of_memory_refuses_and_the_session_is_never_made(make_stack: MakeStack) -> None:
    # The node keeps more memory free than any host has: its guard refuses every sandbox.
    s = await make_stack(capacity=NodeCapacity(8192, 32, 16, memory_reserve_mib=1 << 40))
    user = await s.tenant_key("t1")
    async with s.client(user) as client:
        answer = await client.post("/v1/sessions", json={"template": "base", "metadata": {"k": "v"}})
        assert_problem(answer, 503, "no_capacity")
        assert "node is short of memory" in answer.json()["detail"]
        assert (await client.get("/v1/sessions")).json()["items"] == []
    async with plane_of(s).db() as db:
        assert (await db.execute(select(SessionRow))).all() == []
        assert (await db.execute(select(SessionMetadataRow))).all() == []

"""The public API end to end (HTTP -> control plane -> node agent -> real guest daemon), on SQLite and
PostgreSQL. The runtime is the fake one (guest daemons as host processes); tests/integration repeats the
user-facing paths with real VMs."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from typing import Any

import httpx
import pytest

from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem
from tests.support.waits import eventually

pytestmark = pytest.mark.timeout(120)


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    session: dict[str, Any] = response.json()
    return session


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- health, errors ------
async def test_health_ready_and_problem_json_for_framework_errors(stack: ApiStack) -> None:
    async with stack.client(None) as anon:
        health = await anon.get("/v1/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert (await anon.get("/v1/ready")).json() == {"status": "ready"}
        assert_problem(await anon.get("/v1/nope"), 404, "not_found")
        assert_problem(await anon.put("/v1/health"), 405, "method_not_allowed")
    async with stack.client(stack.admin_key) as admin:
        body = assert_problem(
            await admin.post("/v1/sessions", json={"timeout": 0, "env": {"1bad": "x"}}),
            422,
            "validation_error",
        )
        fields = {e["field"] for e in body["errors"]}
        assert {"body.timeout", "body.env.1bad.[key]"} <= fields or "body.timeout" in fields, fields
        body = assert_problem(
            await admin.post(
                "/v1/sessions", content=b"{not json", headers={"content-type": "application/json"}
            ),
            422,
            "validation_error",
        )
        assert body["errors"]


# -- auth ------
async def test_auth_missing_wrong_malformed_and_revoked_keys(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    key_id = key.rsplit("_", 1)[0]
    bad = [None, "garbage", key[:-1] + ("A" if key[-1] != "A" else "B"), "csk_aaaaaaaaaaaa_" + "b" * 32]
    for token in bad:
        async with stack.client(token) as client:
            response = await client.get("/v1/sessions")
            assert_problem(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
    async with stack.client(key) as client:
        assert (await client.get("/v1/sessions")).status_code == 200
        assert_problem(await client.get("/v1/keys"), 403, "forbidden")
        assert_problem(await client.post("/v1/keys", json={"tenant": "x"}), 403, "forbidden")
        assert_problem(await client.get("/v1/nodes"), 403, "forbidden")
        assert_problem(await client.delete(f"/v1/keys/{key_id}"), 403, "forbidden")
    async with stack.client(stack.admin_key) as admin:
        listed = (await admin.get("/v1/keys")).json()["items"]
        entry = next(k for k in listed if k["id"] == key_id)
        assert "key" not in entry and entry["tenant"] == "acme" and entry["revoked_at"] is None
        revoked = await admin.delete(f"/v1/keys/{key_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        assert_problem(await admin.delete("/v1/keys/csk_doesnotexist"), 404, "not_found")
    async with stack.client(key) as client:
        assert_problem(await client.get("/v1/sessions"), 401, "unauthorized")


async def test_keys_are_stored_hashed(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    plane = stack.replicas[0].app.state.plane
    from sqlalchemy import text

    async with plane.db() as db:
        rows = (await db.execute(text("SELECT id, secret_hash FROM api_keys"))).all()
    assert all(
        key not in (row.id + row.secret_hash) and key.split("_")[2] not in row.secret_hash for row in rows
    )
    assert len(rows) >= 2


# -- lifecycle, commands, files ------
async def test_session_lifecycle_commands_files_and_cleanup(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        session = await create(c, timeout=600, env={"GREETING": "hi"}, metadata={"team": "a"})
        sid = session["id"]
        assert session["state"] == "running" and session["tenant"] == "acme"
        assert session["metadata"] == {"team": "a"} and session["node_id"] == stack.node_id
        assert (await c.get(f"/v1/sessions/{sid}")).json()["state"] == "running"

        result = await c.post(
            f"/v1/sessions/{sid}/commands",
            json={"cmd": "echo $GREETING $X; echo oops >&2; exit 3", "env": {"X": "there"}},
        )
        assert result.status_code == 200, result.text
        body = result.json()
        assert body["stdout"] == "hi there\n" and body["stderr"] == "oops\n" and body["exit_code"] == 3
        assert body["timed_out"] is False and body["signal"] is None and body["duration_ms"] > 0

        argv = (
            await c.post(
                f"/v1/sessions/{sid}/commands", json={"cmd": ["cat"], "stdin": "from stdin", "cwd": "/tmp"}
            )
        ).json()
        assert argv["stdout"] == "from stdin" and argv["exit_code"] == 0
        slow = (await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "sleep 30", "timeout": 0.5})).json()
        assert slow["timed_out"] is True

        # NDJSON streaming
        lines: list[dict[str, Any]] = []
        async with c.stream(
            "POST",
            f"/v1/sessions/{sid}/commands",
            json={"cmd": "printf a; sleep 0.2; printf b >&2; printf c"},
            headers={"Accept": "application/x-ndjson"},
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("application/x-ndjson")
            async for line in response.aiter_lines():
                if line:
                    lines.append(json.loads(line))
        assert lines[-1]["type"] == "result" and lines[-1]["exit_code"] == 0
        assert "stdout" not in lines[-1]
        assert "".join(e["data"] for e in lines if e["type"] == "stdout") == "ac"
        assert "".join(e["data"] for e in lines if e["type"] == "stderr") == "b"

        # files
        payload = bytes(range(256)) * 1000
        put = await c.put(
            f"/v1/sessions/{sid}/files/content",
            params={"path": "/tmp/d/x.bin", "mode": "600"},
            content=payload,
        )
        assert put.status_code == 404 or put.status_code == 200, put.text
        if put.status_code == 404:  # parent missing: create it first
            assert_problem(put, 404, "not_found")
            mk = await c.post(f"/v1/sessions/{sid}/files/mkdir", params={"path": "/tmp/d"})
            assert mk.status_code == 200 and mk.json()["type"] == "dir"
            put = await c.put(
                f"/v1/sessions/{sid}/files/content",
                params={"path": "/tmp/d/x.bin", "mode": "600"},
                content=payload,
            )
        assert put.status_code == 200, put.text
        assert put.json()["size"] == len(payload) and put.json()["mode"] == 0o600
        got = await c.get(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/d/x.bin"})
        assert got.status_code == 200 and got.content == payload
        empty = await c.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/d/empty"}, content=b"")
        assert empty.status_code == 200 and empty.json()["size"] == 0
        assert (
            await c.get(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/d/empty"})
        ).content == b""
        listing = (await c.get(f"/v1/sessions/{sid}/files/list", params={"path": "/tmp/d"})).json()["items"]
        assert sorted(i["name"] for i in listing) == ["empty", "x.bin"]
        stat = (await c.get(f"/v1/sessions/{sid}/files/stat", params={"path": "/tmp/d/x.bin"})).json()
        assert stat["type"] == "file" and stat["size"] == len(payload)
        assert_problem(
            await c.get(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/none"}), 404, "not_found"
        )
        assert_problem(
            await c.get(f"/v1/sessions/{sid}/files/stat", params={"path": "relative"}),
            422,
            "validation_error",
        )

        archive = await c.get(f"/v1/sessions/{sid}/files/archive", params={"path": "/tmp/d"})
        assert archive.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            assert any(name.endswith("x.bin") for name in tar.getnames())
        imported = await c.put(
            f"/v1/sessions/{sid}/files/archive", params={"path": "/tmp/copy"}, content=archive.content
        )
        assert imported.status_code == 204, imported.text
        copied = await c.get(f"/v1/sessions/{sid}/files/list", params={"path": "/tmp/copy"})
        assert copied.status_code == 200, copied.text
        removed = await c.delete(f"/v1/sessions/{sid}/files", params={"path": "/tmp/d", "recursive": "true"})
        assert removed.status_code == 204
        assert_problem(
            await c.get(f"/v1/sessions/{sid}/files/stat", params={"path": "/tmp/d"}), 404, "not_found"
        )

        # background processes
        started = await c.post(
            f"/v1/sessions/{sid}/commands", json={"cmd": "echo started; sleep 60", "background": True}
        )
        assert started.status_code == 201, started.text
        pid = started.json()["pid"]
        assert started.json()["running"] is True
        items = (await c.get(f"/v1/sessions/{sid}/processes")).json()["items"]
        assert pid in [p["pid"] for p in items]
        for _ in range(50):
            out = (await c.get(f"/v1/sessions/{sid}/processes/{pid}/output")).json()
            if out["stdout"]:
                break
            await asyncio.sleep(0.05)
        assert out["stdout"] == "started\n" and out["running"] is True
        killed = await c.post(f"/v1/sessions/{sid}/processes/{pid}/kill", json={"signal": 9})
        assert killed.status_code == 200
        for _ in range(50):
            info = (await c.get(f"/v1/sessions/{sid}/processes/{pid}")).json()
            if not info["running"]:
                break
            await asyncio.sleep(0.05)
        assert info["running"] is False and info["signal"] == 9
        assert_problem(await c.get(f"/v1/sessions/{sid}/processes/999999"), 404, "not_found")

        # close: the sandbox and its daemon are gone, the record stays
        fake = stack.runtime.list()[0]
        daemon_pid, workdir = fake.pid, fake.workdir  # type: ignore[attr-defined]
        closed = await c.post(f"/v1/sessions/{sid}/close")
        assert closed.status_code == 200 and closed.json()["state"] == "closed"
        assert closed.json()["closed_at"] is not None
        assert stack.runtime.list() == [] and stack.agent is not None and stack.agent.list() == []
        assert not pid_alive(daemon_pid) and not workdir.exists()
        again = await c.delete(f"/v1/sessions/{sid}")
        assert again.status_code == 200 and again.json() == closed.json()
        assert_problem(
            await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 409, "invalid_state"
        )
        assert_problem(
            await c.post(f"/v1/sessions/{sid}/timeout", json={"timeout": 10}), 409, "invalid_state"
        )


async def test_list_filters_and_pagination(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        made = [await create(c, metadata={"batch": "x" if i % 2 else "y", "n": str(i)}) for i in range(5)]
        await c.post(f"/v1/sessions/{made[0]['id']}/close")
        seen: list[str] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 2}
            if cursor:
                params["cursor"] = cursor
            page = (await c.get("/v1/sessions", params=params)).json()
            assert len(page["items"]) <= 2
            seen += [s["id"] for s in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert sorted(seen) == sorted(s["id"] for s in made) and len(seen) == len(set(seen))
        running = (await c.get("/v1/sessions", params={"state": "running"})).json()["items"]
        assert {s["id"] for s in running} == {s["id"] for s in made[1:]}
        xs = (await c.get("/v1/sessions", params={"metadata.batch": "x"})).json()["items"]
        assert {s["id"] for s in xs} == {made[1]["id"], made[3]["id"]}
        both = (await c.get("/v1/sessions", params={"metadata.batch": "x", "metadata.n": "3"})).json()[
            "items"
        ]
        assert [s["id"] for s in both] == [made[3]["id"]]
        assert_problem(await c.get("/v1/sessions", params={"cursor": "!!!"}), 422, "validation_error")
        assert_problem(await c.get("/v1/sessions", params={"state": "bogus"}), 422, "validation_error")
        assert_problem(await c.get("/v1/sessions", params={"limit": 0}), 422, "validation_error")
        for s in made[1:]:
            await c.delete(f"/v1/sessions/{s['id']}")


async def test_extend_timeout(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        session = await create(c, timeout=5)
        extended = (await c.post(f"/v1/sessions/{session['id']}/timeout", json={"timeout": 3000})).json()
        assert extended["expires_at"] > session["expires_at"]
        assert_problem(
            await c.post(f"/v1/sessions/{session['id']}/timeout", json={"timeout": 0}),
            422,
            "validation_error",
        )
        await c.delete(f"/v1/sessions/{session['id']}")


# -- tenant isolation ------
async def test_tenant_isolation_on_every_session_route(stack: ApiStack) -> None:
    alice, bob = await stack.tenant_key("alice"), await stack.tenant_key("bob")
    async with stack.client(alice) as a, stack.client(bob) as b:
        sid = (await create(a))["id"]
        await a.post(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/secret"})
        await a.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/secret"}, content=b"alice")
        proc = (
            await a.post(f"/v1/sessions/{sid}/commands", json={"cmd": "sleep 60", "background": True})
        ).json()
        pid = proc["pid"]
        p = {"path": "/tmp/secret"}
        attempts: list[tuple[str, str, dict[str, Any]]] = [
            ("GET", f"/v1/sessions/{sid}", {}),
            ("POST", f"/v1/sessions/{sid}/timeout", {"json": {"timeout": 5}}),
            ("POST", f"/v1/sessions/{sid}/commands", {"json": {"cmd": "cat /tmp/secret"}}),
            (
                "POST",
                f"/v1/sessions/{sid}/commands",
                {"json": {"cmd": "cat /tmp/secret"}, "headers": {"Accept": "application/x-ndjson"}},
            ),
            ("POST", f"/v1/sessions/{sid}/commands", {"json": {"cmd": "sleep 1", "background": True}}),
            ("GET", f"/v1/sessions/{sid}/processes", {}),
            ("GET", f"/v1/sessions/{sid}/processes/{pid}", {}),
            ("GET", f"/v1/sessions/{sid}/processes/{pid}/output", {}),
            ("POST", f"/v1/sessions/{sid}/processes/{pid}/kill", {"json": {"signal": 9}}),
            ("GET", f"/v1/sessions/{sid}/files/content", {"params": p}),
            ("PUT", f"/v1/sessions/{sid}/files/content", {"params": p, "content": b"bob"}),
            ("GET", f"/v1/sessions/{sid}/files/list", {"params": {"path": "/tmp"}}),
            ("GET", f"/v1/sessions/{sid}/files/stat", {"params": p}),
            ("POST", f"/v1/sessions/{sid}/files/mkdir", {"params": {"path": "/tmp/bobdir"}}),
            ("DELETE", f"/v1/sessions/{sid}/files", {"params": p}),
            ("GET", f"/v1/sessions/{sid}/files/archive", {"params": {"path": "/tmp"}}),
            ("PUT", f"/v1/sessions/{sid}/files/archive", {"params": {"path": "/tmp"}, "content": b""}),
            ("POST", f"/v1/sessions/{sid}/close", {}),
            ("DELETE", f"/v1/sessions/{sid}", {}),
        ]
        for method, url, kwargs in attempts:
            assert_problem(await b.request(method, url, **kwargs), 404, "not_found")
        assert sid not in [s["id"] for s in (await b.get("/v1/sessions")).json()["items"]]
        # Nothing Bob tried had an effect.
        still = (await a.get(f"/v1/sessions/{sid}")).json()
        assert still["state"] == "running"
        assert (await a.get(f"/v1/sessions/{sid}/files/content", params=p)).content == b"alice"
        assert (await a.get(f"/v1/sessions/{sid}/processes/{pid}")).json()["running"] is True
        await a.delete(f"/v1/sessions/{sid}")


# -- rate limits ------
@pytest.mark.usefixtures("pinned_rate_window")
async def test_rate_limits_per_key(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(
        settings={"session_create_limit": 2, "command_limit": 3, "rate_window_seconds": 3600}
    )
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("acme")
    async with stack.client(key) as c, stack.client(other) as o:
        s1 = await create(c)
        await create(c)
        body = assert_problem(await c.post("/v1/sessions", json={}), 429, "rate_limited")
        retry = int((await c.post("/v1/sessions", json={})).headers["retry-after"])
        assert 1 <= retry <= 3600 and body["retry_after"] >= 1
        await create(o)  # another key has its own budget
        for _ in range(3):
            assert (
                await c.post(f"/v1/sessions/{s1['id']}/commands", json={"cmd": "true"})
            ).status_code == 200
        limited = await c.post(f"/v1/sessions/{s1['id']}/commands", json={"cmd": "true"})
        assert_problem(limited, 429, "rate_limited")
        assert int(limited.headers["retry-after"]) >= 1
        # The counter lives in the database: a second replica sees the same budget.
        replica = await stack.add_replica()
        async with stack.client(key, url=replica.url) as c2:
            assert_problem(await c2.post("/v1/sessions", json={}), 429, "rate_limited")
        for s in (await c.get("/v1/sessions")).json()["items"] + (await o.get("/v1/sessions")).json()[
            "items"
        ]:
            await c.delete(f"/v1/sessions/{s['id']}")
            await o.delete(f"/v1/sessions/{s['id']}")


# -- failures ------
async def test_boot_failure_leaves_failed_session_and_nothing_on_node(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    stack.runtime.boot_error = "simulated boot failure"  # type: ignore[attr-defined]
    async with stack.client(key) as c:
        body = assert_problem(await c.post("/v1/sessions", json={}), 409, "session_failed")
        sid = body["session_id"]
        failed = (await c.get(f"/v1/sessions/{sid}")).json()
        assert failed["state"] == "failed" and "simulated boot failure" in failed["failure_reason"]
        assert stack.runtime.list() == [] and stack.agent is not None and stack.agent.used()["sandboxes"] == 0
        assert_problem(
            await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 409, "session_failed"
        )
        closed = await c.delete(f"/v1/sessions/{sid}")
        assert closed.status_code == 200 and closed.json()["state"] == "failed"


async def test_dead_sandbox_fails_session(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        s1, s2 = await create(c), await create(c)
        sandboxes = {sb.id: sb for sb in stack.runtime.list()}
        assert len(sandboxes) == 2
        for sb in sandboxes.values():
            os.kill(sb.pid, 9)  # type: ignore[attr-defined]
        agent = stack.agent
        assert agent is not None
        # The node's watcher notices both deaths (bounded: it takes a moment).
        await eventually(lambda: agent.failed_sandboxes() == sorted(sandboxes), "both sandboxes seen dead",
                         within=10)
        # One is found through a command, the other through the node's heartbeat.
        assert_problem(
            await c.post(f"/v1/sessions/{s1['id']}/commands", json={"cmd": "true"}), 409, "session_failed"
        )
        assert (await stack.heartbeat()).status_code == 200
        for s in (s1, s2):
            state = (await c.get(f"/v1/sessions/{s['id']}")).json()
            assert state["state"] == "failed", state
        assert stack.runtime.list() == []


async def test_no_capacity_and_unknown_template(make_stack: Any) -> None:
    from capsa.node.agent.capacity import NodeCapacity

    stack: ApiStack = await make_stack(capacity=NodeCapacity(memory_mib=1024, vcpus=4, max_sandboxes=1))
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        assert_problem(await c.post("/v1/sessions", json={"template": "nope"}), 404, "template_not_found")
        assert_problem(await c.post("/v1/sessions", json={"memory_mib": 2048}), 503, "no_capacity")
        s = await create(c)
        assert_problem(await c.post("/v1/sessions", json={}), 503, "no_capacity")
        await c.delete(f"/v1/sessions/{s['id']}")
        s = await create(c)  # capacity is released by close
        await c.delete(f"/v1/sessions/{s['id']}")


# -- reaper, restarts, replicas ------
async def test_reaper_closes_expired_and_idle_sessions(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        ttl = await create(c, timeout=1)
        idle = await create(c, timeout=600, idle_timeout=1)
        keep = await create(c, timeout=600, idle_timeout=30)
        for _ in range(60):
            states = {s["id"]: s for s in (await c.get("/v1/sessions")).json()["items"]}
            if states[ttl["id"]]["state"] == "closed" and states[idle["id"]]["state"] == "closed":
                break
            await asyncio.sleep(0.1)
        assert states[ttl["id"]]["state"] == "closed" and states[ttl["id"]]["failure_reason"] == "timeout"
        assert states[idle["id"]]["state"] == "closed"
        assert states[idle["id"]]["failure_reason"] == "idle_timeout"
        assert states[keep["id"]]["state"] == "running"
        assert [sb.id for sb in stack.runtime.list()] and len(stack.runtime.list()) == 1
        await c.delete(f"/v1/sessions/{keep['id']}")


async def test_reaper_works_after_control_plane_restart(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"reaper_interval": 0})  # first replica never reaps
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        session = await create(c, timeout=1)
    await stack.replicas[0].stop()
    stack.replicas.clear()
    await asyncio.sleep(1.2)  # past the session's timeout, with no replica running: time must pass
    assert len(stack.runtime.list()) == 1  # nobody reaped it yet
    replica = await stack.add_replica(reaper_interval=0.2)  # "restart" with a reaper, same database
    async with stack.client(key, url=replica.url) as c:
        for _ in range(50):
            state = (await c.get(f"/v1/sessions/{session['id']}")).json()
            if state["state"] == "closed":
                break
            await asyncio.sleep(0.1)
        assert state["state"] == "closed" and state["failure_reason"] == "timeout"
    assert stack.runtime.list() == []


async def test_two_replicas_serve_the_same_sessions(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    second = await stack.add_replica()
    async with stack.client(key) as a, stack.client(key, url=second.url) as b:
        session = await create(a, metadata={"k": "v"})
        sid = session["id"]
        assert (await b.get(f"/v1/sessions/{sid}")).json() == (await a.get(f"/v1/sessions/{sid}")).json()
        await b.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/f"}, content=b"via b")
        ran = (await a.post(f"/v1/sessions/{sid}/commands", json={"cmd": "cat /tmp/f"})).json()
        assert ran["stdout"] == "via b"
        assert (await b.post(f"/v1/sessions/{sid}/close")).json()["state"] == "closed"
        assert (await a.get(f"/v1/sessions/{sid}")).json()["state"] == "closed"
        assert_problem(
            await a.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 409, "invalid_state"
        )


async def test_silent_node_fails_its_sessions(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"node_heartbeat_timeout": 1.0, "node_dead_after_s": 1.0})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c, stack.client(None) as anon:
        session = await create(c)
        for _ in range(60):
            state = (await c.get(f"/v1/sessions/{session['id']}")).json()
            if state["state"] == "failed":
                break
            await asyncio.sleep(0.1)
        assert state["state"] == "failed" and state["failure_reason"] == "node_lost"
        assert_problem(await anon.get("/v1/ready"), 503, "not_ready")
        assert_problem(await c.post("/v1/sessions", json={}), 503, "no_capacity")
        assert (await stack.heartbeat()).status_code == 200
        assert (await anon.get("/v1/ready")).status_code == 200
    assert stack.runtime.list() == []


async def test_nodes_admin_routes_and_heartbeat_auth(stack: ApiStack) -> None:
    async with stack.client(stack.admin_key) as admin:
        nodes = (await admin.get("/v1/nodes")).json()["items"]
        assert [n["id"] for n in nodes] == [stack.node_id]
        assert "token" not in nodes[0] and nodes[0]["healthy"] is True
        assert nodes[0]["capacity"]["max_sandboxes"] == stack.capacity.max_sandboxes
        hb = await admin.post(f"/v1/nodes/{stack.node_id}/heartbeat", json={"used": {"sandboxes": 0}})
        assert hb.status_code == 200
        assert_problem(await admin.post("/v1/nodes/ghost/heartbeat", json={}), 404, "not_found")
        assert_problem(
            await admin.post(
                "/v1/nodes",
                json={
                    "id": "n",
                    "url": "ftp://x",
                    "token": "t" * 20,
                    "capacity": {"memory_mib": 1, "vcpus": 1, "max_sandboxes": 1},
                },
            ),
            422,
            "validation_error",
        )
    async with stack.client("wrong-node-token-xxxxxxxx") as node:
        assert_problem(await node.post(f"/v1/nodes/{stack.node_id}/heartbeat", json={}), 401, "unauthorized")
    async with stack.client(await stack.tenant_key("acme")) as user:
        assert_problem(await user.post(f"/v1/nodes/{stack.node_id}/heartbeat", json={}), 403, "forbidden")


async def test_heartbeat_reconciles_sandboxes_whose_destroy_was_lost(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        keep, lost = await create(c), await create(c)
        # The session ends but the destroy call never reaches the node (e.g. the node was unreachable).
        plane = stack.replicas[0].app.state.plane
        from capsa.control.sessions.states import transition

        async with plane.db() as db:
            assert await transition(db, lost["id"], "closed")
            await db.commit()
        assert len(stack.runtime.list()) == 2
        answer = await stack.heartbeat()
        assert answer.status_code == 200
        assert len(answer.json()["destroy_sandboxes"]) == 1
        assert len(stack.runtime.list()) == 1
        assert (await c.post(f"/v1/sessions/{keep['id']}/commands", json={"cmd": "true"})).status_code == 200
        await c.delete(f"/v1/sessions/{keep['id']}")


async def test_upload_larger_than_the_limit_is_refused(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"max_file_bytes": 1000})
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        sid = (await create(c))["id"]
        params = {"path": "/tmp/big"}
        assert_problem(
            await c.put(f"/v1/sessions/{sid}/files/content", params=params, content=b"x" * 1001),
            413,
            "payload_too_large",
        )

        async def chunks() -> Any:  # no Content-Length: the limit is enforced while streaming
            for _ in range(5):
                yield b"y" * 400

        assert_problem(
            await c.put(f"/v1/sessions/{sid}/files/content", params=params, content=chunks()),
            413,
            "payload_too_large",
        )
        assert_problem(await c.get(f"/v1/sessions/{sid}/files/stat", params=params), 404, "not_found")
        ok = await c.put(f"/v1/sessions/{sid}/files/content", params=params, content=b"z" * 1000)
        assert ok.status_code == 200 and ok.json()["size"] == 1000
        await c.delete(f"/v1/sessions/{sid}")


async def test_close_while_creating_destroys_the_new_sandbox(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    runtime = stack.runtime
    real_boot = runtime.boot
    booting = asyncio.Event()
    release = asyncio.Event()

    async def slow_boot(*args: Any, **kwargs: Any) -> Any:
        booting.set()
        await release.wait()
        return await real_boot(*args, **kwargs)

    runtime.boot = slow_boot  # type: ignore[method-assign]
    async with stack.client(key) as c:
        creating = asyncio.create_task(c.post("/v1/sessions", json={}))
        await booting.wait()
        (listed,) = (await c.get("/v1/sessions")).json()["items"]
        assert listed["state"] == "creating"
        closed = await c.delete(f"/v1/sessions/{listed['id']}")
        assert closed.json()["state"] == "closed"
        release.set()
        answer = await creating
        assert answer.status_code in (201, 409), answer.text
        assert (await c.get(f"/v1/sessions/{listed['id']}")).json()["state"] == "closed"
        assert runtime.list() == [] and stack.agent is not None and stack.agent.list() == []


async def test_bootstrap_key_generated_once(tmp_path: Any) -> None:
    from capsa.control.settings import ControlSettings
    from capsa.frontends import build_app
    from tests.support.api_stack import serve_app

    printed: list[str] = []
    settings = ControlSettings(database_url=f"sqlite+aiosqlite:///{tmp_path}/b.db", reaper_interval=0)
    first = await serve_app(build_app(settings, on_bootstrap_key=printed.append))
    await first.stop()
    second = await serve_app(build_app(settings, on_bootstrap_key=printed.append))
    try:
        assert len(printed) == 1 and printed[0].startswith("csk_")
        async with httpx.AsyncClient(
            base_url=second.url, headers={"Authorization": f"Bearer {printed[0]}"}
        ) as c:
            keys = (await c.get("/v1/keys")).json()["items"]
            assert [k["admin"] for k in keys] == [True] and keys[0]["name"] == "bootstrap"
    finally:
        await second.stop()


async def test_ndjson_output_arrives_while_the_command_runs(stack: ApiStack) -> None:
    # The command only finishes after the client reacts to its first line: a buffered stream would hang.
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c, stack.client(key) as side:
        sid = (await create(c))["id"]
        cmd = "echo ready; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo done"
        seen: list[str] = []
        async with c.stream(
            "POST",
            f"/v1/sessions/{sid}/commands",
            json={"cmd": cmd, "timeout": 60},
            headers={"Accept": "application/x-ndjson"},
        ) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event["type"] == "stdout":
                    seen.append(event["data"])
                    if "ready" in event["data"]:
                        put = await side.put(
                            f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/go"}, content=b""
                        )
                        assert put.status_code == 200
                if event["type"] == "result":
                    assert event["exit_code"] == 0 and event["timed_out"] is False
        assert "".join(seen) == "ready\ndone\n"
        await c.delete(f"/v1/sessions/{sid}")


async def test_placement_picks_the_node_with_most_free_memory(make_stack: Any, tmp_path: Any) -> None:
    from capsa.node.agent.agent import NodeAgent
    from capsa.node.agent.capacity import NodeCapacity
    from capsa.node.api.app import create_node_app
    from capsa.node.templates.source import ColdBootSource
    from tests.support.api_stack import serve_app
    from tests.support.fake_runtime import FakeRuntime, fake_image

    stack: ApiStack = await make_stack(capacity=NodeCapacity(memory_mib=2048, vcpus=8, max_sandboxes=8))
    extra_agents = []
    servers = []
    try:
        for name, memory, templates in (("small", 1024, ["base"]), ("other-template", 65536, ["gpu"])):
            runtime, image = FakeRuntime(), fake_image(tmp_path / name)
            agent = NodeAgent(runtime, image, node_id=name, capacity=NodeCapacity(memory, 8, 8),
                              source=ColdBootSource(runtime, {t: image for t in templates}))
            server = await serve_app(
                create_node_app(agent, "token-" + "x" * 20),
                uds=str(tmp_path / f"{name}.sock"),
                lifespan="off",
            )
            extra_agents.append(agent)
            servers.append(server)
            async with stack.client(stack.admin_key) as admin:
                registered = await admin.post(
                    "/v1/nodes",
                    json={
                        "id": name,
                        "url": server.url,
                        "token": "token-" + "x" * 20,
                        "capacity": {"memory_mib": memory, "vcpus": 8, "max_sandboxes": 8},
                        "templates": templates,
                    },
                )
                assert registered.status_code == 201, registered.text
        key = await stack.tenant_key("acme")
        async with stack.client(key) as c:
            placed = [(await create(c, memory_mib=512))["node_id"] for _ in range(4)]
            # free memory before each placement: node-test 2048/1536/1024(tie)/..., small 1024
            assert placed[:2] == [stack.node_id, stack.node_id]
            assert sorted(placed[2:]) == sorted([stack.node_id, "small"])
            assert len(extra_agents[0].list()) == 1 and extra_agents[1].list() == []
            gpu = await create(c, template="gpu")
            assert gpu["node_id"] == "other-template"
            for s in (await c.get("/v1/sessions")).json()["items"]:
                await c.delete(f"/v1/sessions/{s['id']}")
        assert all(a.list() == [] for a in extra_agents) and stack.runtime.list() == []
    finally:
        for server in servers:
            await server.stop()
        for agent in extra_agents:
            await agent.close()

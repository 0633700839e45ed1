"""Pause/resume/branch/snapshots through the whole server side with host-process guests (fake runtime).

Control plane and the production node agent behind real HTTP servers (tests/support/api_stack.py). The
fake runtime snapshots a guest's files (not its processes), so these tests cover the flows end to end
(pause/resume, restore, branch, rolling snapshots, close deleting snapshots) and what the control plane
decides on its own: the session options, validation, legal states, tenant scoping, and that a refused
request changes nothing. The same paths with real microVMs are in tests/integration/test_api_snapshots_vm.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from capsa.control.sessions.rolling import _due, due_sessions
from capsa.control.sessions.snapshots import prune_aged_rolling
from capsa.control.sessions.states import transition
from capsa.control.store.models import SessionRow, SnapshotRow, utcnow
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime

pytestmark = pytest.mark.postgresql

_needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                 reason="the fake runtime snapshots only confined guests (root)")


def _problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["code"] == code, response.text


async def _row(stack: ApiStack, session_id: str) -> SessionRow:
    async with stack.plane.db() as db:
        row = await db.get(SessionRow, session_id)
        assert row is not None
        return row


async def test_session_options_are_stored_and_shown(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        plain = (await c.post("/v1/sessions", json={})).json()
        assert plain["on_timeout"] == "close" and plain["rolling_snapshots"] is None
        assert plain["keep_snapshots"] is False and plain["pause_reason"] is None
        created = await c.post("/v1/sessions", json={
            "on_timeout": "pause", "keep_snapshots": True, "env": {"A": "1"},
            "rolling_snapshots": {"interval_s": 60, "after_command": True}})
        assert created.status_code == 201, created.text
        ses = created.json()
        assert ses["on_timeout"] == "pause" and ses["keep_snapshots"] is True
        assert ses["rolling_snapshots"] == {"interval_s": 60, "after_command": True, "keep": 3,
                                            "max_age_s": None}
        assert (await c.get(f"/v1/sessions/{ses['id']}")).json() == ses
        assert (await c.get(f"/v1/sessions/{ses['id']}/snapshots")).json() == {"items": []}
        row = await _row(stack, ses["id"])
        # The env is kept so a resumed or branched sandbox gets it again.
        assert row.env == {"A": "1"} and row.timeout_s == 3600
        for sid in (plain["id"], ses["id"]):
            await c.post(f"/v1/sessions/{sid}/close")


async def _picture(stack: ApiStack, c: httpx.AsyncClient, sid: str) -> tuple[Any, ...]:
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    listed = (await c.get("/v1/sessions", params={"limit": 500})).json()
    assert stack.agent is not None
    return (info["state"], info["updated_at"], info["pause_reason"],
            sorted(s["id"] for s in listed["items"]), sorted(r.id for r in stack.agent.list()),
            (await c.get(f"/v1/sessions/{sid}/snapshots")).json())


@pytest.mark.parametrize("body", [
    {"n": 0}, {"n": 33}, {"n": 10000}, {"n": -1}, {"n": "3"}, {"n": 2.5}, {"n": None}, {"n": 2, "x": 1},
])
async def test_branch_count_is_validated_and_changes_nothing(stack: ApiStack, body: dict[str, Any]) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        before = await _picture(stack, c, sid)
        _problem(await c.post(f"/v1/sessions/{sid}/branch", json=body), 422, "validation_error")
        assert await _picture(stack, c, sid) == before
        await c.post(f"/v1/sessions/{sid}/close")


async def test_refused_requests_change_nothing(stack: ApiStack) -> None:
    key, intruder_key = await stack.tenant_key("acme"), await stack.tenant_key("intruder")
    async with stack.client(key) as c, stack.client(intruder_key) as intruder:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        before = await _picture(stack, c, sid)
        _problem(await c.post(f"/v1/sessions/{sid}/resume"), 409, "invalid_state")  # running, not paused
        _problem(await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": "snap_" + "a" * 20}), 404,
                 "snapshot_not_found")
        for bad in ("snap_short", "../../x", "", None):
            _problem(await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": bad}), 422,
                     "validation_error")
        _problem(await c.post(f"/v1/sessions/{sid}/snapshots", json={"kind": "rolling"}), 422,
                 "validation_error")
        _problem(await c.post("/v1/sessions", json={"template": "nope"}), 404, "template_not_found")
        for bad_create in ({"on_timeout": "explode"}, {"rolling_snapshots": {"keep": 0}},
                           {"rolling_snapshots": {"interval_s": 1}}, {"rolling_snapshots": {"keep": 99}},
                           {"keep_snapshots": "maybe"}):
            _problem(await c.post("/v1/sessions", json=bad_create), 422, "validation_error")
        # Another tenant's session does not exist for the intruder.
        for path in ("pause", "resume", "snapshots"):
            _problem(await intruder.post(f"/v1/sessions/{sid}/{path}", json={}), 404, "not_found")
        _problem(await intruder.get(f"/v1/sessions/{sid}/snapshots"), 404, "not_found")
        _problem(await intruder.post(f"/v1/sessions/{sid}/branch", json={"n": 1}), 404, "not_found")
        _problem(await intruder.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": "snap_" + "a" * 20}),
                 404, "not_found")
        _problem(await c.post("/v1/sessions/ses_nonexistent/pause"), 404, "not_found")
        assert await _picture(stack, c, sid) == before

        await c.post(f"/v1/sessions/{sid}/close")
        closed = await _picture(stack, c, sid)
        for path, body in (("pause", None), ("resume", None), ("snapshots", {}), ("branch", {"n": 2}),
                           ("restore", {"snapshot_id": "snap_" + "a" * 20})):
            response = await c.post(f"/v1/sessions/{sid}/{path}", json=body)
            assert response.status_code in (404, 409), response.text
            if path != "restore":
                _problem(response, 409, "invalid_state")
        assert await _picture(stack, c, sid) == closed


async def test_node_without_snapshot_support_leaves_the_session_running(make_stack: Any) -> None:
    # A node agent without the snapshots part refuses: the request fails, the session keeps its sandbox.
    stack: ApiStack = await make_stack(snapshots=False)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        before = await _picture(stack, c, sid)
        for path in ("pause", "snapshots"):
            _problem(await c.post(f"/v1/sessions/{sid}/{path}", json={}), 501, "snapshots_unavailable")
        ran = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "echo hi"})
        assert ran.json()["stdout"] == "hi\n"
        after = await _picture(stack, c, sid)
        assert after[0] == "running" and after[3:] == before[3:]
        await c.post(f"/v1/sessions/{sid}/close")


async def test_after_command_policy_marks_the_session_due(make_stack: Any) -> None:
    # No background rolling pass: it would claim the due session (and take its snapshot) while the test
    # asks due_sessions, which leaves claimed sessions out.
    stack: ApiStack = await make_stack(settings={"rolling_snapshot_interval": 0})
    key = await stack.tenant_key("acme")
    plane = stack.plane
    async with stack.client(key) as c:
        policy = {"rolling_snapshots": {"after_command": True}}
        wants = (await c.post("/v1/sessions", json=policy)).json()["id"]
        plain = (await c.post("/v1/sessions", json={})).json()["id"]
        assert (await _row(stack, wants)).snapshot_wanted_at is None
        for sid in (wants, plain):
            assert (await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"})).status_code == 200
        assert (await _row(stack, wants)).snapshot_wanted_at is not None
        assert (await _row(stack, plain)).snapshot_wanted_at is None
        assert wants in await due_sessions(plane) and plain not in await due_sessions(plane)
        for sid in (wants, plain):
            await c.post(f"/v1/sessions/{sid}/close")
        assert await due_sessions(plane) == []  # only running sessions are snapshotted


def test_interval_policy_needs_time_and_activity() -> None:
    now = utcnow()
    long_ago = now - timedelta(seconds=100)
    row = SessionRow(id="ses_x", created_at=long_ago, last_activity_at=long_ago, snapshot_interval_s=60,
                     snapshot_keep=3, snapshot_wanted_at=None, last_snapshot_at=None)
    assert _due(row, now)  # never snapshotted, interval passed: the first one is taken regardless
    row.last_snapshot_at = now - timedelta(seconds=90)
    assert not _due(row, now)  # nothing happened since the last snapshot
    row.last_activity_at = now - timedelta(seconds=10)
    assert _due(row, now)
    row.last_snapshot_at = now - timedelta(seconds=30)
    assert not _due(row, now)  # activity, but the interval has not passed
    row.snapshot_wanted_at = now
    assert _due(row, now)  # a finished command wants one now
    row.snapshot_wanted_at, row.snapshot_interval_s = None, None
    assert not _due(row, now)


async def test_transition_sources_must_be_legal(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
    async with stack.plane.db() as db:
        with pytest.raises(ValueError, match="illegal transition"):
            await transition(db, sid, "running", sources=("closed",))
        # A legal but non-matching source does nothing.
        assert not await transition(db, sid, "running", sources=("paused",))
        states = (await db.execute(select(SessionRow.state).where(SessionRow.id == sid))).scalars().all()
        assert states == ["running"]
    async with stack.client(key) as c:
        await c.post(f"/v1/sessions/{sid}/close")


async def test_one_replica_at_a_time_claims_a_rolling_snapshot(stack: ApiStack) -> None:
    # Two replicas share the database; the lease is a conditional update, so exactly one wins it.
    from capsa.control.sessions.rolling import _claim, _release

    second = await stack.add_replica()
    planes = [stack.plane, second.app.state.plane]
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        body = {"rolling_snapshots": {"after_command": True}}
        sid = (await c.post("/v1/sessions", json=body)).json()["id"]
        await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"})
        first = await _claim(planes[0], sid)
        assert first is not None and await _claim(planes[1], sid) is None
        assert sid not in await due_sessions(planes[1])  # claimed: not due for anyone else
        await _release(planes[0], sid, first, done=True)
        row = await _row(stack, sid)
        assert row.snapshot_claim_until is None and row.snapshot_wanted_at is None
        await c.post(f"/v1/sessions/{sid}/close")


# -- the flows end to end (the fake runtime snapshots a guest's files; needs root for its confinement) --

async def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json() if response.content else None


async def _sh(c: httpx.AsyncClient, sid: str, cmd: str) -> str:
    result = await _ok(await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd}))
    assert result["exit_code"] == 0, result
    return str(result["stdout"])


def _snapshot_dirs(stack: ApiStack) -> set[str]:
    assert isinstance(stack.runtime, FakeRuntime)
    return set(stack.runtime.list_snapshot_ids())


@_needs_root
async def test_pause_resume_restore_branch_and_close(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        ses = await _ok(await c.post("/v1/sessions", json={"env": {"ROLE": "parent"}}), 201)
        sid = ses["id"]
        await _sh(c, sid, "echo kept > /tmp/note")

        paused = await _ok(await c.post(f"/v1/sessions/{sid}/pause"))
        assert paused["state"] == "paused"
        assert stack.agent is not None and stack.agent.list() == []  # the sandbox is gone
        snaps = (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]
        assert [s["kind"] for s in snaps] == ["pause"] and snaps[0]["id"] in _snapshot_dirs(stack)

        resumed = await _ok(await c.post(f"/v1/sessions/{sid}/resume"))
        assert resumed["state"] == "running"
        assert await _sh(c, sid, "cat /tmp/note; echo $ROLE") == "kept\nparent\n"

        # Roll back: a file written after a snapshot is as it was.
        manual = await _ok(await c.post(f"/v1/sessions/{sid}/snapshots", json={}), 201)
        await _sh(c, sid, "echo later > /tmp/note")
        restored = await _ok(await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": manual["id"]}))
        assert restored["state"] == "running"
        assert await _sh(c, sid, "cat /tmp/note") == "kept\n"

        # Branch into three: each has the file; writes in one do not show in another or the parent.
        branched = await _ok(await c.post(f"/v1/sessions/{sid}/branch", json={"n": 3}), 201)
        kids = [k["id"] for k in branched["items"]]
        assert len(set(kids)) == 3 and sid not in kids
        for i, kid in enumerate(kids):
            assert await _sh(c, kid, "cat /tmp/note; echo $ROLE") == "kept\nparent\n"
            await _sh(c, kid, f"echo kid{i} > /tmp/note")
        await _sh(c, sid, "echo parent > /tmp/note")
        for i, kid in enumerate(kids):
            assert await _sh(c, kid, "cat /tmp/note") == f"kid{i}\n"
        assert await _sh(c, sid, "cat /tmp/note") == "parent\n"

        taken = {s["id"] for s in (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]}
        assert taken and taken <= _snapshot_dirs(stack)
        for s in (*kids, sid):
            await _ok(await c.post(f"/v1/sessions/{s}/close"))
        assert not (taken & _snapshot_dirs(stack))  # closing deletes the session's snapshots on the node
        assert stack.agent.list() == [] and stack.runtime.list() == []


@_needs_root
async def test_rolling_snapshot_after_a_command_restores(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        body = {"rolling_snapshots": {"after_command": True, "keep": 2}}
        sid = (await _ok(await c.post("/v1/sessions", json=body), 201))["id"]
        await _sh(c, sid, "echo one > /tmp/r")
        deadline = time.monotonic() + 60
        while True:  # the control plane's reaper takes it in the background
            snaps = (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]
            rolling = [s for s in snaps if s["kind"] == "rolling"]
            if rolling:
                break
            assert time.monotonic() < deadline, "no rolling snapshot was taken"
            await asyncio.sleep(0.2)
        await _sh(c, sid, "echo two > /tmp/r")
        await _ok(await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": rolling[0]["id"]}))
        assert await _sh(c, sid, "cat /tmp/r") == "one\n"
        await _ok(await c.post(f"/v1/sessions/{sid}/close"))
        assert rolling[0]["id"] not in _snapshot_dirs(stack)


async def test_rolling_snapshots_older_than_their_max_age_go_but_the_newest(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        body = {"rolling_snapshots": {"after_command": True, "keep": 5, "max_age_s": 60}}
        sid = (await _ok(await c.post("/v1/sessions", json=body), 201))["id"]
        assert (await _ok(await c.get(f"/v1/sessions/{sid}")))["rolling_snapshots"]["max_age_s"] == 60
        for n in range(3):  # one rolling snapshot after each command
            await _sh(c, sid, f"echo {n} > /tmp/r")
            deadline = time.monotonic() + 60
            while len([s for s in (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]
                       if s["kind"] == "rolling"]) <= n:
                assert time.monotonic() < deadline, "no rolling snapshot was taken"
                await asyncio.sleep(0.2)
        async with stack.plane.db() as db:  # all three are two minutes older now
            taken = await db.execute(select(SnapshotRow).where(SnapshotRow.session_id == sid))
            for snap in taken.scalars():
                snap.created_at -= timedelta(minutes=2)
            await db.commit()
        items = (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]
        newest, *older = [s["id"] for s in items if s["kind"] == "rolling"]
        # The stack's reaper (every 0.2 s) runs the same pass: between the two, each old one goes once.
        deleted = await prune_aged_rolling(stack.plane)
        assert set(deleted) <= set(older) and len(deleted) == len(set(deleted))
        deadline = time.monotonic() + 30
        while (left := [s["id"] for s in (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]]
               ) != [newest]:
            assert time.monotonic() < deadline, left
            await asyncio.sleep(0.2)
        assert not set(older) & _snapshot_dirs(stack)
        assert await prune_aged_rolling(stack.plane) == []  # the newest stays however old
        await _ok(await c.post(f"/v1/sessions/{sid}/close"))


async def test_no_route_reaches_another_tenants_snapshot_by_its_id(stack: ApiStack) -> None:
    owner, intruder = await stack.tenant_key("acme"), await stack.tenant_key("evil")
    async with stack.client(owner) as a, stack.client(intruder) as b:
        victim = (await _ok(await a.post("/v1/sessions", json={}), 201))["id"]
        await _sh(a, victim, "echo secret-plans > /tmp/plans")
        snap = (await _ok(await a.post(f"/v1/sessions/{victim}/snapshots", json={}), 201))["id"]
        mine = (await _ok(await b.post("/v1/sessions", json={}), 201))["id"]
        # Restore onto the intruder's own session from the id; its listing; its own pause and resume.
        _problem(await b.post(f"/v1/sessions/{mine}/restore", json={"snapshot_id": snap}), 404,
                 "snapshot_not_found")
        listed = (await _ok(await b.get(f"/v1/sessions/{mine}/snapshots")))["items"]
        assert snap not in {s["id"] for s in listed}
        await _ok(await b.post(f"/v1/sessions/{mine}/pause"))
        await _ok(await b.post(f"/v1/sessions/{mine}/resume"))
        assert "secret-plans" not in await _sh(b, mine, "cat /tmp/plans 2>&1 || true")
        for sid, c in ((victim, a), (mine, b)):
            await _ok(await c.post(f"/v1/sessions/{sid}/close"))

"""Issue 27, M4: one tenant cannot fill the nodes' storage with snapshots and paused sessions.

Against the real control plane and node agent over HTTP (fake runtime: real guest daemons as confined host
processes, whose snapshots are real files on the node), on SQLite and PostgreSQL. Each attack comes from
one tenant and goes past one limit; each refusal is ``application/problem+json`` with a stable code and
leaves nothing behind (no snapshot row, no snapshot on the node, no branch); another tenant is unaffected:

- the snapshot count and byte quotas (``max_snapshots``, ``max_snapshot_bytes``; bytes as the node reports
  them) refuse manual snapshots, branches (which snapshot first) and pauses;
- paused sessions count (``max_paused_sessions``), also for the reaper's ``on_timeout: pause``;
- manual snapshots are rate limited per key (``snapshot_limit``);
- ``keep_snapshots`` keeps an ended session's snapshots for ``keep_snapshots_days``, counted in the quota.

The node's own free-space floor is in test_node_space_floor.py.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from capsa.control.store.models import SessionRow, SnapshotRow, utcnow
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime
from tests.support.waits import eventually

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.postgresql,
    pytest.mark.skipif(os.geteuid() != 0, reason="the fake runtime snapshots only confined guests (root)"),
]

MakeStack = Callable[..., Awaitable[ApiStack]]
MiB = 1024 * 1024


def _problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code, response.text
    return body


async def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


async def _session(c: httpx.AsyncClient, **body: Any) -> str:
    return str((await _ok(await c.post("/v1/sessions", json=body), 201))["id"])


async def _write(c: httpx.AsyncClient, sid: str, mib: int) -> None:
    """``mib`` MiB of incompressible data in the guest's /tmp (what its snapshots hold)."""
    ran = await _ok(await c.post(f"/v1/sessions/{sid}/commands",
                                 json={"cmd": f"head -c {mib * MiB} /dev/urandom > /tmp/blob-$$"}))
    assert ran["exit_code"] == 0, ran


async def _snapshot_ids(c: httpx.AsyncClient, sid: str) -> set[str]:
    return {s["id"] for s in (await _ok(await c.get(f"/v1/sessions/{sid}/snapshots")))["items"]}


def _on_node(stack: ApiStack) -> set[str]:
    """The snapshots that exist as files on the node."""
    assert isinstance(stack.runtime, FakeRuntime)
    return set(stack.runtime.list_snapshot_ids())


async def _rows(stack: ApiStack, tenant: str) -> int:
    async with stack.plane.db() as db:
        return int(await db.scalar(select(func.count()).select_from(SnapshotRow)
                                   .where(SnapshotRow.tenant == tenant)) or 0)


async def test_snapshot_count_quota_refuses_snapshots_branches_and_pauses_of_one_tenant(
        make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"tenant_quota": {"max_snapshots": 2}})
    async with stack.client(await stack.tenant_key("greedy")) as g, \
            stack.client(await stack.tenant_key("other")) as o:
        sid = await _session(g)
        taken = {(await _ok(await g.post(f"/v1/sessions/{sid}/snapshots"), 201))["id"] for _ in range(2)}
        before = _on_node(stack)
        assert taken <= before

        refused = _problem(await g.post(f"/v1/sessions/{sid}/snapshots"), 403, "quota_exceeded")
        assert "snapshots 3 > 2" in refused["detail"]
        # A branch of a running session snapshots it first; a pause keeps a snapshot: both refused.
        _problem(await g.post(f"/v1/sessions/{sid}/branch", json={"n": 1}), 403, "quota_exceeded")
        _problem(await g.post(f"/v1/sessions/{sid}/pause"), 403, "quota_exceeded")

        # Nothing was made: no snapshot row or file, no branch; the session still runs.
        assert await _snapshot_ids(g, sid) == taken and await _rows(stack, "greedy") == 2
        assert _on_node(stack) == before
        assert [s["id"] for s in (await _ok(await g.get("/v1/sessions")))["items"]] == [sid]
        assert (await _ok(await g.get(f"/v1/sessions/{sid}")))["state"] == "running"

        # The other tenant has its own quota, untouched by the first one's snapshots.
        other = await _session(o)
        for _ in range(2):
            await _ok(await o.post(f"/v1/sessions/{other}/snapshots"), 201)
        assert await _rows(stack, "other") == 2

        # Closing frees the quota (the snapshots of an ended session are deleted).
        await _ok(await g.post(f"/v1/sessions/{sid}/close"))
        again = await _session(g)
        await _ok(await g.post(f"/v1/sessions/{again}/snapshots"), 201)


async def test_snapshot_byte_quota_counts_what_the_node_reports_and_deletes_the_snapshot_over_it(
        make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"tenant_quota": {"max_snapshot_bytes": 6 * MiB}})
    async with stack.client(await stack.tenant_key("greedy")) as g, \
            stack.client(await stack.tenant_key("other")) as o:
        sid = await _session(g)
        await _write(g, sid, 4)
        first = await _ok(await g.post(f"/v1/sessions/{sid}/snapshots"), 201)
        assert first["size_bytes"] >= 4 * MiB
        before = _on_node(stack)

        # The second snapshot is taken (its size is only known then), found over the quota, deleted.
        refused = _problem(await g.post(f"/v1/sessions/{sid}/snapshots"), 403, "quota_exceeded")
        assert "snapshot bytes" in refused["detail"]
        assert _on_node(stack) == before
        assert await _snapshot_ids(g, sid) == {first["id"]} and await _rows(stack, "greedy") == 1
        # Branching snapshots first: the same.
        _problem(await g.post(f"/v1/sessions/{sid}/branch", json={"n": 1}), 403, "quota_exceeded")
        assert _on_node(stack) == before and await _rows(stack, "greedy") == 1

        other = await _session(o)
        await _write(o, other, 4)
        assert (await _ok(await o.post(f"/v1/sessions/{other}/snapshots"), 201))["size_bytes"] >= 4 * MiB


async def test_paused_sessions_count_against_a_quota(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"tenant_quota": {"max_paused_sessions": 1}})
    async with stack.client(await stack.tenant_key("greedy")) as g, \
            stack.client(await stack.tenant_key("other")) as o:
        first, second = await _session(g), await _session(g)
        assert (await _ok(await g.post(f"/v1/sessions/{first}/pause")))["state"] == "paused"
        before = _on_node(stack)
        refused = _problem(await g.post(f"/v1/sessions/{second}/pause"), 403, "quota_exceeded")
        assert "paused sessions 2 > 1" in refused["detail"]
        # Refused before the node was asked: the session runs on, no pause snapshot was taken.
        assert (await _ok(await g.get(f"/v1/sessions/{second}")))["state"] == "running"
        ran = await _ok(await g.post(f"/v1/sessions/{second}/commands", json={"cmd": "true"}))
        assert ran["exit_code"] == 0
        assert _on_node(stack) == before and await _snapshot_ids(g, second) == set()

        other = await _session(o)
        assert (await _ok(await o.post(f"/v1/sessions/{other}/pause")))["state"] == "paused"

        # Resuming makes room.
        assert (await _ok(await g.post(f"/v1/sessions/{first}/resume")))["state"] == "running"
        assert (await _ok(await g.post(f"/v1/sessions/{second}/pause")))["state"] == "paused"

        # The reaper's on_timeout=pause counts too: over the quota, the expired session is closed.
        expiring = await _session(g, timeout=1, on_timeout="pause")

        async def ended() -> dict[str, Any] | None:
            got: dict[str, Any] = await _ok(await g.get(f"/v1/sessions/{expiring}"))
            return got if got["state"] not in ("creating", "running") else None

        done = await eventually(ended, "the reaper ends the expired session", within=60)
        assert done["state"] == "closed" and "paused sessions" in done["failure_reason"], done
        paused = (await _ok(await g.get("/v1/sessions", params={"state": "paused"})))["items"]
        assert [s["id"] for s in paused] == [second]


@pytest.mark.usefixtures("pinned_rate_window")
async def test_manual_snapshots_are_rate_limited_per_key(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"snapshot_limit": 2, "rate_window_seconds": 3600})
    async with stack.client(await stack.tenant_key("greedy")) as g, \
            stack.client(await stack.tenant_key("other")) as o:
        sid = await _session(g)
        for _ in range(2):
            await _ok(await g.post(f"/v1/sessions/{sid}/snapshots"), 201)
        before = _on_node(stack)
        limited = await g.post(f"/v1/sessions/{sid}/snapshots")
        _problem(limited, 429, "rate_limited")
        assert int(limited.headers["retry-after"]) >= 1
        assert _on_node(stack) == before and len(await _snapshot_ids(g, sid)) == 2
        other = await _session(o)
        await _ok(await o.post(f"/v1/sessions/{other}/snapshots"), 201)


async def test_kept_snapshots_count_against_the_quota_and_expire(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"tenant_quota": {"max_snapshots": 1}, "keep_snapshots_days": 1})
    async with stack.client(await stack.tenant_key("greedy")) as g:
        kept = await _session(g, keep_snapshots=True)
        snap = (await _ok(await g.post(f"/v1/sessions/{kept}/snapshots"), 201))["id"]
        await _ok(await g.post(f"/v1/sessions/{kept}/close"))
        assert snap in _on_node(stack) and await _snapshot_ids(g, kept) == {snap}

        # Kept after its session ended, it still counts: the tenant is at its quota.
        fresh = await _session(g)
        _problem(await g.post(f"/v1/sessions/{fresh}/snapshots"), 403, "quota_exceeded")

        # Past keep_snapshots_days the reaper deletes it, from the node and the database.
        async with stack.plane.db() as db:
            await db.execute(update(SessionRow).where(SessionRow.id == kept)
                             .values(closed_at=utcnow() - timedelta(days=1, minutes=1)))
            await db.commit()

        async def purged() -> bool:
            return snap not in _on_node(stack) and await _rows(stack, "greedy") == 0

        await eventually(purged, "the reaper deletes the expired kept snapshot", within=60)
        await _ok(await g.post(f"/v1/sessions/{fresh}/snapshots"), 201)

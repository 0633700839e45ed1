"""Security findings 8, 10, 13 and 15 (issue 9), performed against the real control plane and node agent
(fake runtime, real HTTP servers, SQLite and PostgreSQL):

- 8: one sandbox flooding the node's audit buffer (tens of thousands of events) cannot evict another's
  events; denials aggregate; the drops are counted per session in the audit API; a heartbeat copies a
  bounded number of pages; retention by count and age purges without a purged event coming back.
- 10: a node's own heartbeat or re-registration cannot raise its capacity above what it enrolled with (an
  admin can); a node cannot file audit events under a session placed on another node.
- 13: branch, resume and restore count against the per-key rate limit; per-tenant quotas (sessions,
  vCPUs, memory) refuse create, branch and resume with ``quota_exceeded`` (403).
- 15: node URLs are https://, unix:// or http:// on loopback, unless the plane allows insecure URLs.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httpx
import pytest
from sqlalchemy import func, select, update

from capsa.common.node_api import AuditEvent, AuditPage
from capsa.control.audit.egress_retention import purge_audit
from capsa.control.egress import service as egress
from capsa.control.errors import ValidationFailed
from capsa.control.nodes.client import NodeClient
from capsa.control.nodes.urls import check_node_url
from capsa.control.plane import ControlPlane
from capsa.control.store.egress_models import AuditEventRow
from capsa.control.store.models import NodeRow, SessionRow
from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.node_egress import NodeEgress
from tests.support.api_stack import ApiStack

pytestmark = [pytest.mark.timeout(300), pytest.mark.postgresql]

MakeStack = Callable[..., Awaitable[ApiStack]]
API_TOKEN = "node-api-token-" + "c" * 24
FLOOD = 30_000


def _problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code, response.text
    return body


def _event(sandbox: str, session: str | None, n: int, decision: str = "allow") -> EgressEvent:
    return EgressEvent(kind="http", sandbox_id=sandbox, session_id=session, method="GET",
                       destination=f"host{n}.test", status=200 if decision == "allow" else None,
                       decision=decision)  # type: ignore[arg-type]


# -- 8: the node's audit buffer -------------------------------------------------------------------------

def test_a_flooding_sandbox_cannot_evict_anothers_events_from_the_node_buffer() -> None:
    log = AuditLog(capacity=20_000)
    for n in range(10):
        log(_event("sbx_victim", "ses_victim", n))
    started = time.perf_counter()
    for n in range(FLOOD):  # distinct allowed requests: nothing to aggregate
        log(_event("sbx_flood", "ses_flood", n))
    flood_s = time.perf_counter() - started
    for n in range(10, 20):
        log(_event("sbx_victim", "ses_victim", n))
    events = log.read(0, log.epoch, 100_000).events
    victim = [e.destination for _, e in events if e.sandbox_id == "sbx_victim"]
    assert victim == [f"host{n}.test" for n in range(20)]
    flood = [e for _, e in events if e.sandbox_id == "sbx_flood"]
    assert len(flood) == log.per_sandbox == 2000  # its share; its newest events are the ones kept
    assert flood[-1].destination == f"host{FLOOD - 1}.test"
    page = log.read(0, log.epoch, 10)
    assert page.dropped == {"ses_flood": FLOOD - 2000} and page.lost == FLOOD - 2000
    assert len(log) <= log.capacity
    print(f"\n{FLOOD} flooded events recorded in {flood_s * 1000:.0f} ms; buffer {len(log)} events")

    # The whole buffer full of many sandboxes' shares: a newcomer still evicts from the biggest holder.
    full = AuditLog(capacity=1000, per_sandbox=400)
    for sandbox in ("a", "b", "c"):
        for n in range(400):
            full(_event(f"sbx_{sandbox}", f"ses_{sandbox}", n))
    for n in range(5):
        full(_event("sbx_small", "ses_small", n))
    kept = full.read(0, full.epoch, 10_000).events
    assert len(kept) == 1000 and sum(e.sandbox_id == "sbx_small" for _, e in kept) == 5


def test_denials_aggregate_until_collected() -> None:
    log = AuditLog()
    for _ in range(FLOOD):
        log(EgressEvent(kind="http", sandbox_id="sbx_a", session_id="ses_a", destination="evil.test:443",
                        decision="deny", reason="domain not allowed"))
    log(EgressEvent(kind="http", sandbox_id="sbx_a", session_id="ses_a", destination="other.test:443",
                    decision="deny", reason="domain not allowed"))
    (first, other) = [e for _, e in log.read(0, log.epoch, 100).events]
    assert (first.destination, first.count) == ("evil.test:443", FLOOD) and other.count == 1
    # Handed out: the next identical denial is a new event, so the reader's copy stays exact.
    log(EgressEvent(kind="http", sandbox_id="sbx_a", session_id="ses_a", destination="evil.test:443",
                    decision="deny", reason="domain not allowed"))
    (seq, later), = log.read(2, log.epoch, 100).events
    assert seq == 3 and later.count == 1 and len(log) == 3
    # Outside the window: a new event too.
    windowed = AuditLog(aggregate_window=10)
    for t in (0.0, 5.0, 11.0):
        windowed(EgressEvent(kind="dns", sandbox_id="sbx_b", destination="x.test", decision="deny", time=t))
    assert [e.count for _, e in windowed.read(0, windowed.epoch, 10).events] == [2, 1]


async def test_flooded_session_cannot_evict_another_tenants_trail_and_drops_show_in_the_api(
        make_stack: MakeStack) -> None:
    node_egress = NodeEgress.create(netns_prefix=f"ctl{secrets.token_hex(3)}-")
    node_egress.audit = AuditLog(capacity=20_000)  # shares of 2000 events
    node_egress.service.broker.sink = node_egress.audit
    stack = await make_stack(egress=node_egress, settings={"audit_pages_per_collection": 3})
    assert stack.agent is not None
    async with stack.client(await stack.tenant_key("victim")) as v, \
            stack.client(await stack.tenant_key("flooder")) as f:
        victim_sid = (await v.post("/v1/sessions", json={})).json()["id"]
        flood_sid = (await f.post("/v1/sessions", json={})).json()["id"]
        plane = stack.plane
        sandbox = await _sandboxes(plane)
        for n in range(5):
            node_egress.audit(_event(sandbox[victim_sid], victim_sid, n))
        for n in range(FLOOD):
            node_egress.audit(_event(sandbox[flood_sid], flood_sid, n))
        for n in range(5, 10):
            node_egress.audit(_event(sandbox[victim_sid], victim_sid, n))

        assert (await stack.heartbeat()).status_code == 200
        async with plane.db() as db:
            copied = await db.scalar(select(func.count()).select_from(AuditEventRow))
        assert copied is not None and 0 < copied <= 3 * 1000  # bounded pages per heartbeat
        for _ in range(3):
            assert (await stack.heartbeat()).status_code == 200

        trail = (await v.get(f"/v1/sessions/{victim_sid}/audit", params={"limit": 1000})).json()
        assert [e["destination"] for e in trail["items"]] == [f"host{n}.test" for n in range(10)]
        assert trail["dropped"] == 0
        flooded = (await f.get(f"/v1/sessions/{flood_sid}/audit", params={"limit": 1})).json()
        assert flooded["dropped"] == FLOOD - 2000 and flooded["next_cursor"] is not None
        # Replicas agree: a second collection of the same cumulative figure does not double it.
        await egress.collect_audit(plane, await _node(plane, stack.node_id))
        again = (await f.get(f"/v1/sessions/{flood_sid}/audit", params={"limit": 1})).json()
        assert again["dropped"] == FLOOD - 2000


async def _sandboxes(plane: ControlPlane) -> dict[str, str]:
    async with plane.db() as db:
        rows = (await db.execute(select(SessionRow.id, SessionRow.sandbox_id))).all()
    return {sid: sbx for sid, sbx in rows if sbx}


async def _node(plane: ControlPlane, node_id: str) -> NodeRow:
    async with plane.db() as db:
        row = await db.get(NodeRow, node_id)
        assert row is not None
        return row


async def test_audit_retention_by_count_and_age_and_purged_events_do_not_return(
        make_stack: MakeStack) -> None:
    node_egress = NodeEgress.create(netns_prefix=f"ctr{secrets.token_hex(3)}-")
    stack = await make_stack(egress=node_egress, settings={"audit_max_events_per_tenant": 50,
                                                           "reaper_interval": 0})
    assert stack.agent is not None
    async with stack.client(await stack.tenant_key("big")) as b, \
            stack.client(await stack.tenant_key("small")) as s:
        big_sid = (await b.post("/v1/sessions", json={})).json()["id"]
        small_sid = (await s.post("/v1/sessions", json={})).json()["id"]
        plane = stack.plane
        sandbox = await _sandboxes(plane)
        for n in range(300):
            node_egress.audit(_event(sandbox[big_sid], big_sid, n))
        for n in range(20):
            node_egress.audit(_event(sandbox[small_sid], small_sid, n))
        assert (await stack.heartbeat()).status_code == 200
        assert await purge_audit(plane) == 250
        assert (await stack.heartbeat()).status_code == 200  # the node still holds them: not re-copied
        big = (await b.get(f"/v1/sessions/{big_sid}/audit", params={"limit": 1000})).json()["items"]
        assert [e["destination"] for e in big] == [f"host{n}.test" for n in range(250, 300)]
        small = (await s.get(f"/v1/sessions/{small_sid}/audit", params={"limit": 1000})).json()["items"]
        assert len(small) == 20

        # By age: events older than the retention go (time is the control plane's clock at the latest).
        async with plane.db() as db:
            await db.execute(update(AuditEventRow).where(AuditEventRow.session_id == small_sid)
                             .values(time=time.time() - 31 * 86400))
            await db.commit()
        assert await purge_audit(plane) == 20
        assert (await s.get(f"/v1/sessions/{small_sid}/audit")).json()["items"] == []


# -- 10: a leaked node credential or a compromised node ----------------------------------------------------

def _enrol_body(url: str, memory: int = 4096) -> dict[str, Any]:
    return {"url": url, "api_token": API_TOKEN, "templates": ["base"],
            "capacity": {"memory_mib": memory, "vcpus": 8, "max_sandboxes": 4}}


async def _enrol(stack: ApiStack, url: str = "http://127.0.0.1:9") -> httpx.Response:
    async with stack.client(stack.admin_key) as admin:
        token = (await admin.post("/v1/nodes/tokens")).json()["token"]
    async with stack.client(token) as node:
        return await node.post("/v1/nodes/enrol", json=_enrol_body(url))


async def test_a_node_cannot_raise_its_own_capacity(make_stack: MakeStack) -> None:
    stack = await make_stack()
    enrolled = (await _enrol(stack)).json()
    node_id = enrolled["id"]
    huge = {"memory_mib": 1 << 30, "vcpus": 1 << 20, "max_sandboxes": 1 << 20}
    async with stack.client(enrolled["credential"]) as node:
        beat = await node.post(f"/v1/nodes/{node_id}/heartbeat", json={"capacity": huge})
        assert beat.status_code == 200, beat.text
        assert beat.json()["capacity"] == {"memory_mib": 4096, "vcpus": 8, "max_sandboxes": 4}
        again = await node.post(f"/v1/nodes/{node_id}/register", json={
            **_enrol_body("http://127.0.0.1:9"), "capacity": huge})
        assert again.json()["capacity"] == {"memory_mib": 4096, "vcpus": 8, "max_sandboxes": 4}
        smaller = await node.post(f"/v1/nodes/{node_id}/heartbeat", json={
            "capacity": {"memory_mib": 1024, "vcpus": 2, "max_sandboxes": 1}})
        assert smaller.json()["capacity"] == {"memory_mib": 1024, "vcpus": 2, "max_sandboxes": 1}
        # Only an admin raises the limit; the node's credential is not an admin key.
        assert (await node.patch(f"/v1/nodes/{node_id}", json={"capacity_limit": huge})).status_code == 401
    async with stack.client(stack.admin_key) as admin:
        raised = await admin.patch(f"/v1/nodes/{node_id}", json={
            "capacity_limit": {"memory_mib": 16384, "vcpus": 16, "max_sandboxes": 8}})
        assert raised.status_code == 200, raised.text
        assert raised.json()["capacity_limit"] == {"memory_mib": 16384, "vcpus": 16, "max_sandboxes": 8}
        assert raised.json()["capacity"] == {"memory_mib": 1024, "vcpus": 2, "max_sandboxes": 1}
        _problem(await admin.patch("/v1/nodes/nope", json={"capacity_limit": huge}), 404, "not_found")
    async with stack.client(enrolled["credential"]) as node:
        beat = await node.post(f"/v1/nodes/{node_id}/heartbeat", json={"capacity": huge})
        assert beat.json()["capacity"] == {"memory_mib": 16384, "vcpus": 16, "max_sandboxes": 8}


class _LyingNode:
    """What a compromised node answers to an audit read: events filed under whichever session it likes."""

    def __init__(self, session_ids: list[str]) -> None:
        self.session_ids = session_ids

    async def audit(self, *, after: int, epoch: str | None, limit: int) -> AuditPage:
        items = [AuditEvent(seq=n + 1, kind="http", session_id=sid, sandbox_id="sbx_forged", time=time.time(),
                            source=None, destination="forged.test", resolved_ip=None, method="GET",
                            path="/", status=200, bytes_out=0, bytes_in=0, decision="allow", rule=None,
                            reason=None, secret_ids=[], count=1)
                 for n, sid in enumerate(self.session_ids) if n + 1 > after]
        return AuditPage(epoch="evil", items=items, last_seq=len(self.session_ids), lost=0,
                         dropped={sid: 10**6 for sid in self.session_ids})


async def test_a_node_cannot_forge_audit_rows_of_sessions_placed_elsewhere(make_stack: MakeStack) -> None:
    stack = await make_stack()
    victim = await stack.tenant_key("victim")
    async with stack.client(victim) as v:
        victim_sid = (await v.post("/v1/sessions", json={})).json()["id"]
        assert (await _enrol(stack)).status_code == 201
        plane = stack.plane
        async with plane.db() as db:
            rogue = (await db.execute(select(NodeRow).where(NodeRow.id != stack.node_id))).scalar_one()
        liar = _LyingNode([victim_sid, "ses_unknownunknownunkn"])
        assert await egress.collect_audit(plane, rogue, client=cast(NodeClient, liar)) == 0
        trail = (await v.get(f"/v1/sessions/{victim_sid}/audit")).json()
        assert trail["items"] == [] and trail["dropped"] == 0
        async with plane.db() as db:
            assert await db.scalar(select(func.count()).select_from(AuditEventRow)) == 0
        # The node the session is placed on is believed for its own sessions.
        own = await _node(plane, stack.node_id)
        assert await egress.collect_audit(plane, own, client=cast(NodeClient, _LyingNode([victim_sid]))) == 1
        trail = (await v.get(f"/v1/sessions/{victim_sid}/audit")).json()
        assert [e["destination"] for e in trail["items"]] == ["forged.test"]


# -- 13: rate limits and quotas ---------------------------------------------------------------------------

_needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                 reason="the fake runtime snapshots only confined guests (root)")


@_needs_root
@pytest.mark.usefixtures("pinned_rate_window")
async def test_branch_resume_and_restore_are_rate_limited(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"session_create_limit": 4, "rate_window_seconds": 3600})
    async with stack.client(await stack.tenant_key("acme")) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]  # 1
        branched = await c.post(f"/v1/sessions/{sid}/branch", json={"n": 2})  # 3: a branch counts n
        assert branched.status_code == 201, branched.text
        snap = branched.json()["snapshot_id"]
        assert (await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": snap})).status_code == 200
        limited = await c.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": snap})
        _problem(limited, 429, "rate_limited")
        assert int(limited.headers["retry-after"]) >= 1
        assert (await c.post(f"/v1/sessions/{sid}/pause")).status_code == 200  # not a start
        _problem(await c.post(f"/v1/sessions/{sid}/resume"), 429, "rate_limited")
        _problem(await c.post(f"/v1/sessions/{sid}/branch", json={"n": 1}), 429, "rate_limited")


@_needs_root
async def test_tenant_quotas_refuse_create_branch_and_resume(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={
        "tenant_quota": {"max_sessions": 2, "max_vcpus": 3, "max_memory_mib": 1024},
        "tenant_quotas": {"roomy": {"max_sessions": 5, "max_vcpus": 0, "max_memory_mib": 0}}})
    async with stack.client(await stack.tenant_key("acme")) as c:
        first = (await c.post("/v1/sessions", json={"vcpus": 2})).json()["id"]
        body = _problem(await c.post("/v1/sessions", json={"vcpus": 2}), 403, "quota_exceeded")
        assert "vCPUs 4 > 3" in body["detail"]
        _problem(await c.post("/v1/sessions", json={"memory_mib": 1024}), 403, "quota_exceeded")
        second = (await c.post("/v1/sessions", json={})).json()["id"]
        _problem(await c.post("/v1/sessions", json={}), 403, "quota_exceeded")  # 3 sessions > 2
        _problem(await c.post(f"/v1/sessions/{second}/branch", json={"n": 1}), 403, "quota_exceeded")
        listed = (await c.get("/v1/sessions")).json()["items"]
        assert sorted(s["id"] for s in listed) == sorted([first, second])  # refused: nothing was created
        # A paused session holds nothing; resuming it must fit again.
        assert (await c.post(f"/v1/sessions/{first}/pause")).status_code == 200
        third = (await c.post("/v1/sessions", json={"vcpus": 2})).json()["id"]
        _problem(await c.post(f"/v1/sessions/{first}/resume"), 403, "quota_exceeded")
        assert (await c.get(f"/v1/sessions/{first}")).json()["state"] == "paused"
        assert (await c.post(f"/v1/sessions/{third}/close")).status_code == 200
        assert (await c.post(f"/v1/sessions/{first}/resume")).json()["state"] == "running"
    async with stack.client(await stack.tenant_key("roomy")) as r:  # a per-tenant override
        for _ in range(5):
            assert (await r.post("/v1/sessions", json={"vcpus": 2})).status_code == 201
        _problem(await r.post("/v1/sessions", json={}), 403, "quota_exceeded")


# -- 15: node URLs ----------------------------------------------------------------------------------------

def test_node_url_rules() -> None:
    for url in ("https://node.example:8443", "unix:///run/capsa/node.sock", "http://127.0.0.1:9",
                "http://127.8.0.1", "http://localhost:80", "http://[::1]:9"):
        check_node_url(url, allow_insecure=False)
    for url in ("http://10.0.0.5:9", "http://node.example", "http://127.0.0.1.evil.example:9",
                "http://[::ffff:10.0.0.1]:9", "ftp://node.example", "https://",
                # What the HTTP client cannot open (urlsplit drops some control characters silently):
                "https://a\x08b", "https://node example", "http://127.0.0.1:99999", "https://n\u00e9.example",
                "unix:///run/x\ny", "https://node.example:port"):
        with pytest.raises(ValidationFailed):
            check_node_url(url, allow_insecure=False)
    check_node_url("http://10.0.0.5:9", allow_insecure=True)


async def test_plain_http_node_urls_are_refused_off_loopback(make_stack: MakeStack) -> None:
    stack = await make_stack()
    refused = _problem(await _enrol(stack, "http://10.0.0.5:9"), 422, "validation_error")
    assert "https://" in refused["detail"] and "CAPSA_ALLOW_INSECURE_NODE_URLS" in refused["detail"]
    assert (await _enrol(stack, "https://node.example:8443")).status_code == 201
    enrolled = (await _enrol(stack, "http://127.0.0.1:9")).json()
    async with stack.client(enrolled["credential"]) as node:
        moved = await node.post(f"/v1/nodes/{enrolled['id']}/register",
                                json=_enrol_body("http://192.0.2.7:9"))
        _problem(moved, 422, "validation_error")
    async with stack.client(stack.admin_key) as admin:
        by_hand = {"id": "lab-1", "url": "http://192.0.2.8:9", "token": API_TOKEN,
                   "capacity": {"memory_mib": 1024, "vcpus": 1, "max_sandboxes": 1}}
        _problem(await admin.post("/v1/nodes", json=by_hand), 422, "validation_error")
        nodes = (await admin.get("/v1/nodes")).json()["items"]
        assert all(not n["url"].startswith("http://1") or n["url"].startswith("http://127.") for n in nodes)
    lab = await stack.add_replica(allow_insecure_node_urls=True)
    async with stack.client(stack.admin_key, url=lab.url) as admin:
        assert (await admin.post("/v1/nodes", json=by_hand)).status_code == 201

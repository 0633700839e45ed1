"""``GET /metrics`` on the control plane and the node (Prometheus exposition, parsed with the client
library's own parser), who may read it, and the request and session ids on the log lines of a request.

The whole server side runs (tests/support/api_stack.py: the control plane and the production node agent
behind real HTTP servers, host-process guests); each scrape is parsed and the series that a create, a
command, a pause and a resume must move are compared before and after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from capsa.common.logs import REQUEST_ID_HEADER
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.shipping import Shipper
from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.audit_log import AuditLog
from capsa.node.runtime.snapshot.manifest import RAM_FILE, Snapshot, SnapshotManifest
from capsa.store import open_store
from tests.support.api_stack import ApiStack
from tests.support.logs import configured, json_lines
from tests.support.problems import assert_problem

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
METRICS_TOKEN = "scrape-" + "t" * 24


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when the series does not exist yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(stack: ApiStack, key: str | None = None) -> Samples:
    async with stack.client(key or stack.admin_key) as c:
        response = await c.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def node_api(stack: ApiStack) -> httpx.AsyncClient:
    """The stack's node API on its socket, with the API token the node registered with."""
    assert stack.service is not None
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(stack._socket)), base_url="http://node",
                             headers={"Authorization": f"Bearer {stack.service.api_token}"})


async def scrape_node(stack: ApiStack) -> Samples:
    async with node_api(stack) as c:
        response = await c.get("/metrics")
    assert response.status_code == 200, response.text
    return parse(response.text)


def moved(before: Samples, after: Samples) -> Callable[..., float]:
    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)
    return delta


async def test_create_exec_pause_resume_move_the_control_planes_and_the_nodes_series(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    plane_before, node_before = await scrape(stack), await scrape_node(stack)
    async with stack.client(key) as c:
        created = await c.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        ran = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "echo hi"})
        assert ran.status_code == 200 and ran.json()["stdout"] == "hi\n", ran.text
        paused = await c.post(f"/v1/sessions/{sid}/pause")
        assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text
        resumed = await c.post(f"/v1/sessions/{sid}/resume")
        assert resumed.status_code == 200 and resumed.json()["state"] == "running", resumed.text
        missing = await c.get("/v1/sessions/ses_" + "x" * 20)
        assert missing.status_code == 404
        e2b = await c.get("/e2b/sandboxes/" + "x" * 20, headers={"X-API-Key": key})  # a mounted front end
        assert e2b.status_code == 404, e2b.text
    plane_after, node_after = await scrape(stack), await scrape_node(stack)
    delta = moved(plane_before, plane_after)

    # Requests by route template and status, never by raw path (no session id in any label).
    requests = "capsa_http_requests_total"
    assert delta(requests, method="POST", route="/v1/sessions", status="201") == 1
    assert delta(requests, method="POST", route="/v1/sessions/{session_id}/commands", status="200") == 1
    assert delta(requests, method="POST", route="/v1/sessions/{session_id}/pause", status="200") == 1
    assert delta(requests, method="POST", route="/v1/sessions/{session_id}/resume", status="200") == 1
    assert delta(requests, method="GET", route="/v1/sessions/{session_id}", status="404") == 1
    assert delta("capsa_http_request_duration_seconds_count", method="POST",
                 route="/v1/sessions/{session_id}/commands") == 1
    assert delta(requests, method="GET", route="/e2b/sandboxes/{sandbox_id}", status="404") == 1
    assert not [labels for (_name, labels) in plane_after
                if any(sid in v or "x" * 20 in v for _k, v in labels)]

    # Session operations: one observation each, by outcome.
    ops = "capsa_session_operation_duration_seconds_count"
    for operation in ("create", "pause", "resume"):
        assert delta(ops, operation=operation, outcome="ok") == 1, operation
        assert delta(ops, operation=operation, outcome="error") == 0, operation
    assert delta("capsa_session_operation_duration_seconds_sum", operation="create", outcome="ok") > 0

    # Read from the database: the session runs; the node's capacity and use as it registered.
    assert value(plane_before, "capsa_sessions", state="running") == 0
    assert value(plane_after, "capsa_sessions", state="running") == 1
    assert value(plane_after, "capsa_sessions", state="failed") == 0  # every state is exported
    assert value(plane_after, "capsa_node_capacity", node=stack.node_id, resource="memory_mib") == 8192
    assert value(plane_after, "capsa_node_capacity", node=stack.node_id, resource="sandboxes") == 16
    assert value(plane_after, "capsa_node_healthy", node=stack.node_id) == 1

    # The node: a sandbox made at create and one restored at resume; one runs now.
    node_delta = moved(node_before, node_after)
    assert node_delta("capsa_sandbox_create_seconds_count", source="boot") == 1
    assert node_delta("capsa_sandbox_create_seconds_count", source="restore") == 1
    assert value(node_before, "capsa_sandboxes_running") == 0
    assert value(node_after, "capsa_sandboxes_running") == 1
    assert value(node_after, "capsa_approvals_pending") == 0


async def test_metrics_take_the_metrics_token_or_an_admin_key(make_stack: Any) -> None:
    stack: ApiStack = await make_stack(settings={"metrics_token": METRICS_TOKEN})
    tenant = await stack.tenant_key("acme")
    async with stack.client(None) as anonymous:
        assert_problem(await anonymous.get("/metrics"), 401, "unauthorized")
    async with stack.client("scrape-" + "x" * 24) as wrong:
        assert_problem(await wrong.get("/metrics"), 401, "unauthorized")
    async with stack.client(tenant) as c:
        assert_problem(await c.get("/metrics"), 403, "forbidden")
    assert value(await scrape(stack, METRICS_TOKEN), "capsa_sessions", state="running") == 0
    assert value(await scrape(stack, stack.admin_key), "capsa_sessions", state="running") == 0


@pytest.mark.postgresql
async def test_each_replica_counts_its_own_requests_and_reads_the_shared_database(stack: ApiStack) -> None:
    second = await stack.add_replica()
    key = await stack.tenant_key("acme")
    async with stack.client(key, url=second.url) as c:
        assert (await c.post("/v1/sessions", json={})).status_code == 201
    first_says, second_says = await scrape(stack), parse((await _get(second.url, stack.admin_key)).text)
    created = ("capsa_http_requests_total", {"method": "POST", "route": "/v1/sessions", "status": "201"})
    assert value(first_says, created[0], **created[1]) == 0
    assert value(second_says, created[0], **created[1]) == 1
    assert value(first_says, "capsa_sessions", state="running") == 1
    assert value(second_says, "capsa_sessions", state="running") == 1


async def test_lost_sandboxes_reaped_sessions_and_orphans_are_counted(stack: ApiStack) -> None:
    """A stopping node's sessions (one with a snapshot to pause at, one without: it fails), a session past
    its timeout (the reaper closes it), and a sandbox the control plane never asked for (the heartbeat
    answer orders it destroyed)."""
    key = await stack.tenant_key("acme")
    before = await scrape(stack)
    async with stack.client(key) as c:
        brief = (await c.post("/v1/sessions", json={"timeout": 1})).json()
        for _ in range(100):  # the stack's reaper runs every 0.2 s
            if (await c.get(f"/v1/sessions/{brief['id']}")).json()["state"] == "closed":
                break
            await asyncio.sleep(0.1)
        async with node_api(stack) as node:
            made = await node.post("/node/v1/sandboxes", json={"id": "sbx_" + "o" * 20})
            assert made.status_code == 201, made.text
        beat = await stack.heartbeat()
        assert beat.json()["destroy_sandboxes"] == ["sbx_" + "o" * 20]
        bare = (await c.post("/v1/sessions", json={})).json()
        kept = (await c.post("/v1/sessions", json={})).json()
        assert (await c.post(f"/v1/sessions/{kept['id']}/snapshots")).status_code == 201
        async with stack.client(stack.node_token) as node_link:
            assert (await node_link.post(f"/v1/nodes/{stack.node_id}/leave")).status_code == 200
        assert (await c.get(f"/v1/sessions/{bare['id']}")).json()["state"] == "failed"
        assert (await c.get(f"/v1/sessions/{kept['id']}")).json()["state"] == "paused"
    delta = moved(before, await scrape(stack))
    assert delta("capsa_reaper_sessions_total", action="closed") == 1
    assert delta("capsa_orphan_sandboxes_total") == 1
    assert delta("capsa_session_recoveries_total", result="failed") == 1
    assert delta("capsa_session_recoveries_total", result="paused") == 1
    assert delta("capsa_session_recoveries_total", result="recovered") == 0
    after = await scrape(stack)
    assert value(after, "capsa_sessions", state="closed") == 1
    assert value(after, "capsa_node_healthy", node=stack.node_id) == 0  # it left


async def _get(url: str, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
        response = await c.get("/metrics")
    assert response.status_code == 200, response.text
    return response


async def test_log_lines_of_a_request_carry_its_request_id_and_session_id(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        with configured() as out:  # JSON lines of every logger of this process (control plane and node)
            ran = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"},
                               headers={REQUEST_ID_HEADER: "ingress-7f3a"})
        assert ran.status_code == 200, ran.text
    request_id = ran.headers[REQUEST_ID_HEADER]
    assert request_id.startswith("req_")
    lines = json_lines(out)  # type: ignore[arg-type]
    mine = [line for line in lines if line.get("request_id") == request_id]
    # The control plane's access line and the node's (for the call the control plane made for it).
    control = [line for line in mine if f"/v1/sessions/{sid}/commands" in str(line["event"])]
    node = [line for line in mine if "/node/v1/sandboxes/" in str(line["event"])]
    assert control and node, lines
    for line in control + node:
        assert line["session_id"] == sid
    assert control[0]["upstream_request_id"] == "ingress-7f3a"
    assert all(str(line.get("sandbox_id", "")).startswith("sbx_") for line in node)
    # Lines of other requests (none here but this one's) never carry its ids.
    assert all(line.get("session_id") in (None, sid) for line in lines)


async def test_a_forged_log_id_header_is_left_out(stack: ApiStack) -> None:
    async with stack.client(stack.admin_key) as c:
        with configured() as out:
            response = await c.get("/v1/health", headers={REQUEST_ID_HEADER: 'x" forged=1 next line'})
    assert response.status_code == 200
    lines = json_lines(out)  # type: ignore[arg-type]
    assert lines and all("upstream_request_id" not in line for line in lines)
    assert all(line["request_id"] == response.headers[REQUEST_ID_HEADER] for line in lines
               if "/v1/health" in str(line["event"]))


# -- the node's parts ----------------------------------------------------------------------------------

def _render(*collectors: Any) -> Samples:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return parse(generate_latest(registry).decode())


async def test_snapshot_pushes_and_pulls_count_bytes_and_time(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    snap_dir = tmp_path / "node-a" / "snap_abc"
    snap_dir.mkdir(parents=True)
    (snap_dir / RAM_FILE).write_bytes(b"memory page " * 100_000)
    manifest = SnapshotManifest.model_construct(id="snap_abc", labels={"capsa.tenant": "ten_a"})
    shipper = Shipper(store, snap_dir.parent)
    stats = await shipper.push(Snapshot(snap_dir, manifest))
    (tmp_path / "node-b").mkdir()
    puller = Shipper(store, tmp_path / "node-b")
    assert await puller.pull("snap_abc")
    pushed, pulled = _render(*shipper.metrics.collectors()), _render(*puller.metrics.collectors())
    assert stats.sent_bytes > 0
    assert value(pushed, "capsa_snapshot_store_bytes_total", direction="push") == stats.sent_bytes
    assert value(pushed, "capsa_snapshot_store_seconds_count", direction="push", outcome="ok") == 1
    ram_bytes = len(b"memory page ") * 100_000
    assert value(pulled, "capsa_snapshot_store_bytes_total", direction="pull") == ram_bytes
    assert value(pulled, "capsa_snapshot_store_seconds_count", direction="pull", outcome="ok") == 1


def test_egress_decisions_are_counted_by_kind_and_outcome() -> None:
    audit = AuditLog()
    audit(EgressEvent(kind="http", sandbox_id="sbx_a", decision="allow", destination="example.com"))
    for _ in range(3):  # aggregated into one event of the log, counted three times
        audit(EgressEvent(kind="dns", sandbox_id="sbx_a", decision="deny", destination="evil.example"))
    audit(EgressEvent(kind="net", sandbox_id="sbx_a", decision="deny", destination="udp", count=5))
    samples = _render(*audit.metrics.collectors())
    decisions = "capsa_egress_decisions_total"
    assert value(samples, decisions, kind="http", decision="allow") == 1
    assert value(samples, decisions, kind="dns", decision="deny") == 3
    assert value(samples, decisions, kind="net", decision="deny") == 5
    assert len(audit) == 3


async def test_a_node_that_admits_by_real_memory_reports_it(make_stack: Callable[..., Any]) -> None:
    stack: ApiStack = await make_stack(
        settings={"metrics_token": METRICS_TOKEN},
        capacity=NodeCapacity(8192, 32, 16, memory_reserve_mib=0))
    user = await stack.tenant_key("t1")
    async with stack.client(user) as c:
        assert (await c.post("/v1/sessions", json={"template": "base"})).status_code == 201
    assert (await stack.heartbeat()).status_code == 200
    samples = await scrape(stack, METRICS_TOKEN)
    # The fake runtime's guests are host processes: their PSS is real, as is the host's memory left.
    assert value(samples, "capsa_node_used", node=stack.node_id, resource="memory_pss_mib") > 0
    assert value(samples, "capsa_node_used", node=stack.node_id, resource="memory_available_mib") > 256
    assert value(samples, "capsa_node_used", node=stack.node_id, resource="sandboxes") == 1

"""Node-side events in the tenant chain: egress events (DNS answers included), approval and connection
events pulled from the node become chain events of kinds ``egress``/``approval``/``connection``, linked to
their session (and request, when the node names one), once each even when collected twice; and the node's
buffer is durable: events a node agent had not handed out are collected after it is restarted (a new
agent, egress and node API server on the same state file), with the control plane's cursor still valid."""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.node_egress import NodeEgress
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime

pytestmark = [pytest.mark.timeout(180), pytest.mark.postgresql]

KEY = base64.b64encode(os.urandom(32)).decode()


async def _chain(client: Any, **params: Any) -> list[dict[str, Any]]:
    response = await client.get("/v1/audit", params={"limit": 1000, **params})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


async def test_node_events_join_the_chain_once_and_survive_a_node_restart(
        make_stack: Callable[..., Awaitable[ApiStack]], tmp_path: Path) -> None:
    state_file = tmp_path / "node-state" / "egress-audit.jsonl"
    state_file.parent.mkdir()
    node_egress = NodeEgress.create(netns_prefix=f"cua{secrets.token_hex(3)}-", audit_path=state_file)
    # The API's events reach the chain through the group-commit writer, moments after the answer (here up
    # to a second): node events that followed a call must still be chained after it.
    stack = await make_stack(settings={"secret_key": KEY, "audit_linger_ms": 1000}, egress=node_egress)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a:
        sid = (await a.post("/v1/sessions", json={})).json()["id"]
        assert stack.agent is not None
        (record,) = stack.agent.list()
        node_egress.audit(EgressEvent(kind="dns", session_id=sid, sandbox_id=record.id,
                                      destination="api.test", resolved_ip="192.0.2.7", decision="allow"))
        node_egress.audit(EgressEvent(kind="http", session_id=sid, sandbox_id=record.id, method="POST",
                                      destination="api.test:443", path="/v1/x", status=201,
                                      decision="allow"))
        node_egress.audit(EgressEvent(kind="approval", session_id=sid, sandbox_id=record.id,
                                      decision="allow", request_id="req_00000000000000000001",
                                      detail={"action": "approved", "by": "csk_someone", "rule": "r1"}))
        node_egress.audit(EgressEvent(kind="connection", session_id=sid, sandbox_id=record.id,
                                      decision="allow", destination="api.test",
                                      detail={"action": "token_injected", "connection": "con_x"}))
        assert (await stack.heartbeat()).status_code == 200
        assert (await stack.heartbeat()).status_code == 200  # nothing new: nothing chained twice
        node_events = [e for e in await _chain(a, session_id=sid) if e["kind"] != "api"]
        assert [(e["kind"], e["action"]) for e in node_events] == [
            ("session", "create"), ("egress", "dns"), ("egress", "http"), ("approval", "approved"),
            ("connection", "token_injected")]
        dns = node_events[1]["detail"]
        assert dns["resolved_ip"] == "192.0.2.7" and dns["destination"] == "api.test"
        assert node_events[3]["request_id"] == "req_00000000000000000001"
        assert node_events[3]["detail"]["detail"]["by"] == "csk_someone"
        assert all(e["session_id"] == sid for e in node_events)

        # Events the node recorded but no one collected, then the node process goes away.
        node_egress.audit(EgressEvent(kind="dns", session_id=sid, sandbox_id=record.id,
                                      destination="late.test", decision="deny", reason="not allowed"))
        epoch = node_egress.audit.epoch
        # A new node agent process on the same state dir (its egress opens the same buffer file).
        restarted_egress = NodeEgress.create(netns_prefix=f"cua{secrets.token_hex(3)}-",
                                             audit_path=state_file)
        await stack.restart_node(FakeRuntime(), restarted_egress)
        restarted = restarted_egress.audit
        assert restarted.epoch == epoch
        events = await _chain(a, session_id=sid, kind="egress")
        assert [e["detail"]["destination"] for e in events] == ["api.test", "api.test:443", "late.test"]
        assert (await a.get("/v1/audit/verify")).json()["ok"] is True
        # What the control plane stored is pruned from the node's buffer at the next read.
        await stack.heartbeat()
        assert len(restarted) == 0
    async with stack.client(await stack.tenant_key("other")) as o:
        assert await _chain(o, session_id=sid) == []

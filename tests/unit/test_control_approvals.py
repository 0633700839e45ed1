"""Approvals through the whole server side: the node's broker holds a POST of a session's sandbox (on
loopback, with a local upstream), the tenant lists it and decides through ``/v1/approvals`` (another tenant
neither sees nor decides it), the sandbox gets the upstream's answer or a 403, a policy's webhook is POSTed
to, and the session's audit trail names the API key that decided. The broker mechanics are in
test_egress_approvals.py; a real VM's request is in tests/integration/test_approvals_vm.py."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import httpx
import pytest
from click.testing import CliRunner, Result
from fastapi import FastAPI, Request

from capsa.cli.main import cli
from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.net.sandbox_net import ServicePorts
from capsa.sdk import ApprovalInfo, AsyncClient, InvalidState, NotFound
from tests.support.api_stack import ApiStack, serve_app
from tests.support.h11_server import Answer, h11_handler
from tests.support.problems import assert_problem
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(120)


def _charged(request: h11.Request, body: bytes) -> Answer:
    """Answers every request with 200 and a JSON body naming what it received."""
    answer = json.dumps({"charged": request.target.decode(), "body": body.decode()}).encode()
    return 200, [(b"content-type", b"application/json")], answer


_upstream = h11_handler(_charged)


@pytest.fixture
async def upstream_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()


async def _post_through(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    """What the sandbox does: a POST to api.test through the broker's plain-HTTP listener."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: api.test\r\nContent-Length: {len(body)}\r\n"
                 "Connection: close\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


async def _pending(client: httpx.AsyncClient, count: int = 1) -> list[dict[str, Any]]:
    for _ in range(500):
        items: list[dict[str, Any]] = (await client.get("/v1/approvals")).json()["items"]
        if len(items) >= count:
            return items
        await asyncio.sleep(0.02)
    raise AssertionError("no approval became pending")


@dataclass
class Held:
    """A stack whose node's broker holds the sandbox of one of acme's sessions (on loopback)."""

    stack: ApiStack
    key: str
    other: str
    sid: str
    port: int
    notices: list[dict[str, Any]]

    @property
    def key_id(self) -> str:
        return self.key.rsplit("_", 1)[0]


@pytest.fixture
async def held(make_stack: Callable[..., Awaitable[ApiStack]], upstream_port: int) -> AsyncIterator[Held]:
    notices: list[dict[str, Any]] = []
    hooks = FastAPI()

    @hooks.post("/hook")
    async def hook(request: Request) -> dict[str, bool]:
        notices.append(await request.json())
        return {"ok": True}

    receiver = await serve_app(hooks, lifespan="off")
    egress = NodeEgress.create(netns_prefix=f"cap{secrets.token_hex(3)}-",
                               resolver=StaticResolver({"api.test": ["127.0.0.1"]}),
                               allow_networks=["127.0.0.0/8"],
                               webhook_allow_networks=[ipaddress.ip_network("127.0.0.0/8")])
    egress.service.broker.upstreams.http_port = upstream_port
    stack = await make_stack(egress=egress)
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("other")
    sandbox_id = ""
    try:
        async with stack.client(key) as a:
            sid = (await a.post("/v1/sessions", json={})).json()["id"]
        assert stack.agent is not None
        (record,) = stack.agent.list()
        sandbox_id = record.id
        # The session's sandbox, as the node's broker holds it (on loopback instead of a namespace).
        policy = EgressPolicy.from_data({
            "approval_webhook": f"{receiver.url}/hook",
            "domains": [{"domain": "api.test", "approvals": [
                {"name": "charges", "methods": ["POST"], "path_prefixes": ["/v1/charges"], "timeout_s": 60},
                {"name": "slow", "methods": ["POST"], "path_prefixes": ["/v1/slow"], "timeout_s": 1}]}]})
        sbx = egress.service.broker.register(sandbox_id, "127.0.0.1", policy, session_id=sid)
        await egress.service.broker.listen(sandbox_id, "127.0.0.1",
                                           ports=ServicePorts(http=0, tls=0, proxy=0, dns=0))
        yield Held(stack, key, other, sid, int(sbx.bound["http"][1]), notices)
    finally:
        if sandbox_id:
            await egress.service.broker.unregister(sandbox_id)
        await receiver.stop()


async def test_decisions_through_the_api_reach_the_held_request(held: Held) -> None:
    stack, key, sid, port, notices = held.stack, held.key, held.sid, held.port, held.notices
    key_id = held.key_id
    async with stack.client(key) as a, stack.client(held.other) as o:
        call = asyncio.create_task(_post_through(port, "/v1/charges", b'{"amount": 4200}'))
        (pending,) = await _pending(a)
        assert pending["session_id"] == sid and pending["state"] == "pending"
        assert (pending["destination"], pending["method"], pending["path"], pending["approval_rule"]) == (
            "api.test", "POST", "/v1/charges", "charges")
        assert pending["preview"] == '{"amount": 4200}' and "sandbox_id" not in pending
        assert (await a.get("/v1/approvals", params={"session_id": sid})).json()["items"] == [pending]
        assert (await a.get(f"/v1/approvals/{pending['id']}")).json() == pending
        # Another tenant neither sees nor decides it.
        assert (await o.get("/v1/approvals")).json()["items"] == []
        assert_problem(await o.get(f"/v1/approvals/{pending['id']}"), 404, "approval_not_found")
        assert_problem(await o.post(f"/v1/approvals/{pending['id']}/approve"), 404, "approval_not_found")
        assert_problem(await a.get("/v1/approvals/apr_nosuchapprovalxxxxxx"), 404, "approval_not_found")
        assert_problem(await a.post(f"/v1/approvals/{pending['id']}/approve", json={"scope": "always"}),
                       422, "validation_error")
        assert not call.done()

        approved = await a.post(f"/v1/approvals/{pending['id']}/approve", json={"reason": "ok by me"})
        assert approved.status_code == 200, approved.text
        assert approved.json()["state"] == "approved" and approved.json()["decided_by"] == key_id
        status, body = await call
        assert status == 200
        assert json.loads(body) == {"charged": "/v1/charges", "body": '{"amount": 4200}'}
        assert_problem(await a.post(f"/v1/approvals/{pending['id']}/deny"), 409, "approval_decided")

        # Denied: the sandbox gets a 403 naming the approval and the reason.
        call = asyncio.create_task(_post_through(port, "/v1/charges/2", b"{}"))
        (second,) = await _pending(a)
        denied = await a.post(f"/v1/approvals/{second['id']}/deny", json={"reason": "too much"})
        assert denied.status_code == 200 and denied.json()["state"] == "denied"
        status, body = await call
        assert status == 403
        assert json.loads(body) == {"error": "approval_denied", "approval_id": second["id"],
                                    "message": f"approval denied by {key_id}", "reason": "too much",
                                    "decided_by": key_id}
        # Timed out: 403 too; the approval is remembered as timed out.
        status, body = await _post_through(port, "/v1/slow", b"{}")
        assert status == 403 and json.loads(body)["error"] == "approval_timeout"
        timed_id = json.loads(body)["approval_id"]
        assert (await a.get(f"/v1/approvals/{timed_id}")).json()["state"] == "timeout"
        assert_problem(await a.post(f"/v1/approvals/{timed_id}/approve"), 409, "approval_decided")
        assert (await a.get("/v1/approvals")).json()["items"] == []
        decided = (await a.get("/v1/approvals", params={"include_decided": "true"})).json()["items"]
        assert [d["state"] for d in decided] == ["approved", "denied", "timeout"]

        # The webhook was told of every pending approval.
        # (Notices for one URL are coalesced: one POST may carry several.)
        def notified() -> list[str]:
            return [a["id"] for n in notices for a in n["approvals"]]

        for _ in range(400):
            if len(notified()) >= 3:
                break
            await asyncio.sleep(0.02)
        assert notified() == [pending["id"], second["id"], timed_id]
        assert {n["type"] for n in notices} == {"approval.pending"}

        # Bad approval rules are refused at the edge, naming the field.
        bad = await a.post("/v1/sessions", json={"policy": {"domains": [
            {"domain": "api.test", "approvals": [{"timeout_s": 99999, "scope": "forever"}]}]}})
        body = assert_problem(bad, 422, "validation_error")
        messages = " ".join(e["message"] for e in body["errors"])
        assert "approvals.0.timeout_s" in messages and "approvals.0.scope" in messages, body
        bad = await a.put(f"/v1/sessions/{sid}/policy", json={"policy": {"domains": [
            {"domain": "api.test", "download_content_types": ["nonsense"]}]}})
        assert "not a media type" in json.dumps(assert_problem(bad, 422, "validation_error")["errors"])

        # The audit trail names who decided.
        trail = (await a.get(f"/v1/sessions/{sid}/audit", params={"limit": 100})).json()["items"]
        approvals = [e for e in trail if e["kind"] == "approval"]
        assert [e["reason"] for e in approvals] == [
            f"approval {pending['id']} pending (rule charges)",
            f"approval {pending['id']} approved by {key_id} (scope once): ok by me",
            f"approval {second['id']} pending (rule charges)",
            f"approval {second['id']} denied by {key_id} (scope once): too much",
            f"approval {timed_id} pending (rule slow)",
            f"approval {timed_id} timed out"]
        assert [e["decision"] for e in approvals] == ["deny", "allow", "deny", "deny", "deny", "deny"]
        http = [(e["decision"], e["status"], e["path"]) for e in trail if e["kind"] == "http"]
        assert http == [("allow", 200, "/v1/charges"), ("deny", 403, "/v1/charges/2"),
                        ("deny", 403, "/v1/slow")]


async def _cli(stack: ApiStack, key: str, *args: str) -> Result:
    env = {"CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


async def _sdk_pending(client: AsyncClient, session_id: str) -> list[ApprovalInfo]:
    for _ in range(500):
        items = await client.approvals.list(session_id=session_id)
        if items:
            return items
        await asyncio.sleep(0.02)
    raise AssertionError("no approval became pending")


async def test_sdk_and_cli_decide_approvals(held: Held) -> None:
    async with AsyncClient(held.stack.url, held.key) as client:
        call = asyncio.create_task(_post_through(held.port, "/v1/charges/a", b"sdk"))
        (first,) = await _sdk_pending(client, held.sid)
        assert (await client.approvals.get(first.id)).preview == "sdk"
        approved = await client.approvals.approve(first.id, reason="sdk says yes")
        assert approved.state == "approved" and approved.decided_by == held.key_id
        assert (await call)[0] == 200
        with pytest.raises(InvalidState) as info:  # 409: approval_decided
            await client.approvals.deny(first.id)
        assert info.value.code == "approval_decided"
        with pytest.raises(NotFound):
            await client.approvals.get("apr_nosuchapprovalxxxxxx")

        # The CLI: ls --json lists the pending one, approve --session-scope covers the next ones.
        call = asyncio.create_task(_post_through(held.port, "/v1/charges/b", b"cli"))
        await _sdk_pending(client, held.sid)
        listed = await _cli(held.stack, held.key, "approvals", "ls", "--json")
        assert listed.exit_code == 0, listed.output
        (item,) = json.loads(listed.output)["items"]
        assert item["path"] == "/v1/charges/b" and item["state"] == "pending"
        table = await _cli(held.stack, held.key, "approvals", "ls")
        assert item["id"] in table.output and "POST api.test/v1/charges/b" in table.output
        done = await _cli(held.stack, held.key, "approvals", "approve", item["id"], "--session-scope")
        assert done.exit_code == 0, done.output
        assert f"approved {item['id']}" in done.output and "scope session" in done.output
        assert (await call)[0] == 200
        assert (await _post_through(held.port, "/v1/charges/c", b"covered"))[0] == 200
        assert await client.approvals.list() == []

        # A different rule still asks; deny --reason reaches the sandbox.
        call = asyncio.create_task(_post_through(held.port, "/v1/slow", b"x"))
        waiting = await _sdk_pending(client, held.sid)
        denied = await _cli(held.stack, held.key, "approvals", "deny", waiting[0].id, "--reason", "no")
        assert denied.exit_code == 0 and f"denied {waiting[0].id}" in denied.output
        status, body = await call
        assert status == 403 and json.loads(body)["reason"] == "no"
        again = await _cli(held.stack, held.key, "approvals", "deny", waiting[0].id)
        assert again.exit_code != 0 and len(again.output.strip().splitlines()) == 1
        assert "already denied" in again.output

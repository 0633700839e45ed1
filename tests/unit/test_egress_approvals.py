"""Approvals and upload/download restrictions at the broker, on loopback with a local upstream: a held POST
reaches the upstream only once approved (and the sandbox gets the upstream's answer); denial, timeout and a
stopped sandbox answer 403 naming the approval; a session-scoped approval covers later requests; every step
is an audit event naming the decider; the webhook is told about pending approvals. (The decision through
``/v1/approvals`` is in test_control_approvals.py.)"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.node.egress.approvals import Approval
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.h11_server import Answer, h11_handler
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(60)

ANY_PORTS = ServicePorts(http=0, tls=0, proxy=0, dns=0)


@dataclass
class Upstream:
    """A plain-HTTP API on loopback that records what reached it; ``/html`` answers text/html."""

    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def answer(self, request: h11.Request, body: bytes) -> Answer:
        method, path = request.method.decode(), request.target.decode()
        self.seen.append((method, path, body))
        kind = b"text/html" if path.startswith("/html") else b"application/json"
        answer = {"upstream": "ok", "method": method, "path": path, "received": len(body)}
        return 201, [(b"content-type", kind)], json.dumps(answer).encode()


@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> dict[str, object]:
        data = json.loads(self.body)
        assert isinstance(data, dict)
        return data


async def _send(port: int, method: str, path: str, body: bytes = b"", host: str = "api.test",
                chunked: bool = False) -> Reply:
    """One request to the broker's plain-HTTP listener, as the sandbox would send it (``chunked``: the body
    in two chunks, no declared length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    framing = (b"transfer-encoding", b"chunked") if chunked else (b"content-length", str(len(body)).encode())
    pieces = [body[:len(body) // 2], body[len(body) // 2:]] if chunked else [body]
    head = h11.Request(method=method, target=path, headers=[(b"host", host.encode()), framing])
    writer.write((conn.send(head) or b"")
                 + b"".join(conn.send(h11.Data(data=p)) or b"" for p in pieces if p)
                 + (conn.send(h11.EndOfMessage()) or b""))
    await writer.drain()
    response: h11.Response | None = None
    data = b""
    try:
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                chunk = await reader.read(65536)
                conn.receive_data(chunk)
                continue
            if isinstance(ev, h11.Response):
                response = ev
            elif isinstance(ev, h11.Data):
                data += ev.data
            elif isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
                break
    finally:
        writer.close()
    assert response is not None
    return Reply(response.status_code, dict(response.headers), data)


class Notices:
    """Records what the broker queues for the webhook (the sending is in tests/security/test_webhook_ssrf)."""

    def __init__(self, notices: list[dict[str, object]]) -> None:
        self.notices = notices

    async def check(self, url: str) -> None:
        pass

    def notify(self, url: str, approval: dict[str, object]) -> bool:
        self.notices.append({"url": url, "approval": approval})
        return True

    async def close(self) -> None:
        pass


class World:
    def __init__(self, upstream: Upstream, policy: EgressPolicy, notices: list[dict[str, object]]) -> None:
        self.upstream = upstream
        self.sink = ListSink()
        store = InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_1": "REALSECRET-approvals-42"})

        self.broker = EgressBroker(secrets=store, sink=self.sink, resolver=StaticResolver({
            "api.test": ["127.0.0.1"], "files.test": ["127.0.0.1"]}), allow_networks=["127.0.0.0/8"],
            upstream_http_port=upstream.port, notifier=Notices(notices))
        self.policy = policy
        self.sbx: SandboxEgress | None = None

    async def start(self, sandbox_id: str = "sbx_ap", session_id: str = "ses_ap") -> SandboxEgress:
        self.sbx = self.broker.register(sandbox_id, "127.0.0.1", self.policy, session_id=session_id)
        await self.broker.listen(sandbox_id, "127.0.0.1", ports=ANY_PORTS)
        return self.sbx

    @property
    def port(self) -> int:
        assert self.sbx is not None
        return int(self.sbx.bound["http"][1])

    async def pending(self, count: int = 1) -> list[Approval]:
        """Wait until ``count`` approvals are pending."""
        for _ in range(500):
            items = self.broker.approvals.list()
            if len(items) >= count:
                return items
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} approval(s) never became pending")


POLICY = EgressPolicy.from_data({
    "approval_webhook": "http://127.0.0.1:9/hook",
    "domains": [{
        "domain": "api.test",
        "approvals": [
            {"name": "payments", "methods": ["POST"], "path_prefixes": ["/v1/charges"], "timeout_s": 30},
            {"name": "big", "methods": ["PUT"], "min_body_bytes": 100, "timeout_s": 1},
        ],
    }],
    "secrets": [{"secret": "sec_1", "domain": "api.test", "env": "API_KEY"}],
})


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    up.server = await asyncio.start_server(h11_handler(up.answer), "127.0.0.1", 0)
    yield up
    up.server.close()


@pytest.fixture
async def world(upstream: Upstream) -> AsyncIterator[tuple[World, list[dict[str, object]]]]:
    notices: list[dict[str, object]] = []
    w = World(upstream, POLICY, notices)
    await w.start()
    yield w, notices
    await w.broker.close()


async def test_held_post_goes_through_once_approved(world: tuple[World, list[dict[str, object]]]) -> None:
    w, notices = world
    assert w.sbx is not None
    placeholder = w.sbx.placeholder_for("sec_1")
    assert placeholder is not None
    body = b'{"amount": 4200, "note": "' + b"x" * 3000 + b'"}'
    call = asyncio.create_task(_send(w.port, "POST", "/v1/charges?idem=1", body))
    (approval,) = await w.pending()
    # Held, not forwarded: the upstream has seen nothing yet.
    assert w.upstream.seen == [] and not call.done()
    assert (approval.session_id, approval.destination, approval.method, approval.path, approval.rule,
            approval.approval_rule) == ("ses_ap", "api.test", "POST", "/v1/charges?idem=1", "api.test",
                                        "payments")
    assert approval.preview.startswith('{"amount": 4200') and len(approval.preview) == 2048
    assert approval.body_bytes == len(body) and 29 <= approval.expires_at - approval.created_at <= 30
    assert notices and notices[0]["url"] == "http://127.0.0.1:9/hook"
    notice = notices[0]["approval"]
    assert isinstance(notice, dict) and notice["id"] == approval.id and notice["state"] == "pending"

    w.broker.approvals.decide(approval.id, approve=True, decided_by="key_alice", reason="looks right")
    reply = await call
    assert reply.status == 201 and reply.json() == {"upstream": "ok", "method": "POST",
                                                      "path": "/v1/charges?idem=1", "received": len(body)}
    assert w.upstream.seen == [("POST", "/v1/charges?idem=1", body)]
    events = w.sink.find(kind="approval")
    assert [e.detail["decision"] for e in events if e.detail] == ["pending", "approved"]
    assert [e.detail["action"] for e in events if e.detail] == ["requested", "approved"]
    decided = events[-1]
    assert decided.decision == "allow" and decided.detail is not None
    assert decided.detail["decided_by"] == "key_alice" and decided.detail["approval_id"] == approval.id
    assert decided.reason == f"approval {approval.id} approved by key_alice (scope once): looks right"
    allowed = w.sink.find(kind="http", decision="allow")[-1]
    assert allowed.status == 201 and allowed.detail == {"approval_id": approval.id}
    # A second decision of the same approval is refused clearly.
    with pytest.raises(CapsaError) as info:
        w.broker.approvals.decide(approval.id, approve=False, decided_by="key_bob")
    assert info.value.code == "approval_decided" and info.value.status == 409

    # Once-scoped: the next matching POST is held again; other requests pass without asking.
    assert (await _send(w.port, "GET", "/v1/charges")).status == 201
    assert (await _send(w.port, "POST", "/v1/other", b"{}")).status == 201
    again = asyncio.create_task(_send(w.port, "POST", "/v1/charges", b"{}"))
    (second,) = await w.pending()
    assert second.id != approval.id
    w.broker.approvals.decide(second.id, approve=True, decided_by="key_alice")
    assert (await again).status == 201


async def test_denied_and_timed_out_requests_get_403(world: tuple[World, list[dict[str, object]]]) -> None:
    w, _ = world
    call = asyncio.create_task(_send(w.port, "POST", "/v1/charges", b'{"amount": 1}'))
    (approval,) = await w.pending()
    w.broker.approvals.decide(approval.id, approve=False, decided_by="key_bob", reason="not today")
    reply = await call
    assert reply.status == 403 and reply.headers[b"content-type"] == b"application/json"
    assert reply.json() == {"error": "approval_denied", "approval_id": approval.id, "message":
                            "approval denied by key_bob", "reason": "not today", "decided_by": "key_bob"}
    denied = w.sink.find(kind="approval")[-1]
    assert denied.decision == "deny" and denied.detail is not None
    assert (denied.detail["decision"], denied.detail["decided_by"]) == ("denied", "key_bob")
    http = w.sink.find(kind="http", decision="deny")[-1]
    assert http.status == 403 and http.reason is not None and approval.id in http.reason

    # The "big" rule holds only PUTs of 100 bytes or more, for 1 s.
    assert (await _send(w.port, "PUT", "/small", b"x" * 99)).status == 201
    timed = await _send(w.port, "PUT", "/big", b"x" * 100)
    assert timed.status == 403
    body = timed.json()
    assert body["error"] == "approval_timeout" and body["message"] == "approval timed out after 1 s"
    timeout_event = w.sink.find(kind="approval")[-1]
    assert timeout_event.detail is not None and timeout_event.detail["decision"] == "timeout"
    assert timeout_event.detail["approval_id"] == body["approval_id"]
    # Nothing refused ever reached the upstream.
    assert [(m, p) for m, p, _ in w.upstream.seen] == [("PUT", "/small")]


async def test_session_scope_covers_later_requests(world: tuple[World, list[dict[str, object]]]) -> None:
    w, _ = world
    call = asyncio.create_task(_send(w.port, "POST", "/v1/charges", b"1"))
    (approval,) = await w.pending()
    w.broker.approvals.decide(approval.id, approve=True, decided_by="key_alice", scope="session")
    assert (await call).status == 201
    for i in range(3):
        assert (await _send(w.port, "POST", f"/v1/charges/{i}", b"2")).status == 201
    assert w.broker.approvals.list() == []
    assert len(w.sink.find(kind="approval")) == 2  # opened + approved, nothing for the covered ones
    # A policy update drops the grant: it was given under the old rules.
    w.broker.update_policy("sbx_ap", POLICY)
    call = asyncio.create_task(_send(w.port, "POST", "/v1/charges", b"4"))
    (after_update,) = await w.pending()
    w.broker.approvals.decide(after_update.id, approve=True, decided_by="key_alice", scope="session")
    assert (await call).status == 201
    # The grant is the session's sandbox's only: it goes with the sandbox.
    await w.broker.unregister("sbx_ap")
    await w.start("sbx_ap2", "ses_ap")
    call = asyncio.create_task(_send(w.port, "POST", "/v1/charges", b"3"))
    (fresh,) = await w.pending()
    w.broker.approvals.decide(fresh.id, approve=True, decided_by="key_alice")
    assert (await call).status == 201


async def test_a_chunked_body_is_held_whole_and_sized(world: tuple[World, list[dict[str, object]]]) -> None:
    w, _ = world
    # Without a declared length the "big" rule (PUT, 100 bytes or more) can only decide on the whole body.
    assert (await _send(w.port, "PUT", "/small", b"y" * 99, chunked=True)).status == 201
    call = asyncio.create_task(_send(w.port, "PUT", "/big", b"z" * 150, chunked=True))
    (approval,) = await w.pending()
    assert approval.body_bytes == 150 and approval.preview == "z" * 150 and w.upstream.seen[-1][1] == "/small"
    w.broker.approvals.decide(approval.id, approve=True, decided_by="key_c")
    assert (await call).status == 201
    assert w.upstream.seen[-1] == ("PUT", "/big", b"z" * 150)
    assert w.sink.find(kind="http", decision="allow")[-1].bytes_out == 150


async def test_stopping_the_sandbox_denies_its_pending_approvals(
        world: tuple[World, list[dict[str, object]]]) -> None:
    w, _ = world
    calls = [asyncio.create_task(_send(w.port, "POST", f"/v1/charges/{i}", b"{}")) for i in range(2)]
    held = await w.pending(2)
    await w.broker.unregister("sbx_ap")
    replies = await asyncio.gather(*calls)
    assert [r.status for r in replies] == [403, 403]
    assert {r.json()["error"] for r in replies} == {"approval_cancelled"}
    assert w.broker.approvals.list() == [] and w.upstream.seen == []
    states = {a.id: w.broker.approvals.get(a.id).state for a in held}
    assert set(states.values()) == {"cancelled"}
    cancelled = [e for e in w.sink.find(kind="approval") if e.detail and e.detail["decision"] == "cancelled"]
    assert len(cancelled) == 2 and all(e.reason and "the sandbox stopped" in e.reason for e in cancelled)


async def test_a_client_that_gives_up_abandons_its_approval(
        world: tuple[World, list[dict[str, object]]]) -> None:
    w, _ = world
    _reader, writer = await asyncio.open_connection("127.0.0.1", w.port)
    writer.write(b"POST /v1/charges HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    (approval,) = await w.pending()
    writer.close()
    for _ in range(200):
        if w.broker.approvals.get(approval.id).state != "pending":
            break
        await asyncio.sleep(0.01)
    assert w.broker.approvals.get(approval.id).state == "cancelled"
    with pytest.raises(CapsaError):
        w.broker.approvals.decide(approval.id, approve=True, decided_by="key_late")
    assert w.upstream.seen == []


async def test_preview_redacts_placeholders_and_secrets(upstream: Upstream) -> None:
    notices: list[dict[str, object]] = []
    policy = EgressPolicy.from_data({"domains": [{"domain": "api.test", "approvals": [{}]}],
                                     "secrets": [{"secret": "sec_1", "domain": "api.test"}]})
    w = World(upstream, policy, notices)
    sbx = await w.start()
    try:
        call = asyncio.create_task(_send(w.port, "POST", "/x", b"token=REALSECRET-approvals-42&a=1"))
        (approval,) = await w.pending()
        assert approval.preview == "token=[REDACTED]&a=1"
        assert notices == []  # no webhook in this policy
        w.broker.approvals.decide(approval.id, approve=True, decided_by="key_a")
        assert (await call).status == 201
        # A placeholder in a held body is refused as in any body, before anyone is asked.
        ph = sbx.placeholder_for("sec_1")
        assert ph is not None
        refused = await _send(w.port, "POST", "/x", f"t={ph}".encode())
        assert refused.status == 403 and b"placeholder of sec_1 in the request body" in refused.body
        assert w.broker.approvals.list() == []
    finally:
        await w.broker.close()


async def test_upload_and_download_restrictions(upstream: Upstream) -> None:
    policy = EgressPolicy.from_data({"domains": [
        {"domain": "api.test", "forbid_uploads_above": 0, "download_content_types": ["application/json"]},
        {"domain": "files.test", "forbid_uploads_above": 10, "download_content_types": ["text/*"]},
    ]})
    w = World(upstream, policy, [])
    await w.start()
    try:
        assert (await _send(w.port, "GET", "/a")).status == 201  # JSON, no body: allowed
        refused = await _send(w.port, "POST", "/a", b"1")
        assert refused.status == 403
        assert b"uploads to api.test are forbidden (any request body)" in refused.body
        html = await _send(w.port, "GET", "/html/page")
        assert html.status == 403 and b"upstream" not in html.body
        assert b"download of content type text/html is not allowed for api.test" in html.body
        assert (await _send(w.port, "POST", "/html/x", b"0123456789", host="files.test")).status == 201
        big = await _send(w.port, "POST", "/html/x", b"0123456789!", host="files.test")
        assert big.status == 403 and b"request bodies over 10 bytes" in big.body
        json_from_files = await _send(w.port, "GET", "/data", host="files.test")
        assert json_from_files.status == 403
        assert b"content type application/json is not allowed for files.test" in json_from_files.body
        denies = w.sink.find(kind="http", decision="deny")
        assert [e.reason for e in denies] == [
            "uploads to api.test are forbidden (any request body)",
            "download of content type text/html is not allowed for api.test",
            "uploads to files.test are forbidden (request bodies over 10 bytes)",
            "download of content type application/json is not allowed for files.test"]
        # Refused uploads never reached the upstream; refused downloads did (the upstream answered), but
        # their bodies were not relayed.
        assert [(m, p) for m, p, _ in upstream.seen] == [
            ("GET", "/a"), ("GET", "/html/page"), ("POST", "/html/x"), ("GET", "/data")]
    finally:
        await w.broker.close()


def test_approval_rules_are_validated() -> None:
    from capsa.common.egress_policy import PolicyError

    for doc, fragment in [
        ({"domains": [{"domain": "a.test", "approvals": [{"timeout_s": 0}]}]}, "timeout_s"),
        ({"domains": [{"domain": "a.test", "approvals": [{"timeout_s": 3601}]}]}, "timeout_s"),
        ({"domains": [{"domain": "a.test", "approvals": [{"scope": "forever"}]}]}, "scope"),
        ({"domains": [{"domain": "a.test", "approvals": [{"name": "x"}, {"name": "x"}]}]}, "used twice"),
        ({"domains": [{"domain": "a.test", "approvals": [{"path_prefixes": ["nope"]}]}]}, "path prefix"),
        ({"domains": [{"domain": "a.test", "download_content_types": ["json"]}]}, "not a media type"),
        ({"domains": [{"domain": "a.test", "forbid_uploads_above": -1}]}, "forbid_uploads_above"),
        ({"approval_webhook": "file:///etc/passwd"}, "approval_webhook"),
        ({"approval_webhook": "https://user:pw@example.com/"}, "without credentials"),
    ]:
        with pytest.raises(PolicyError) as info:
            EgressPolicy.from_data(doc)
        assert fragment in info.value.message, (doc, info.value.message)
    rule = EgressPolicy.from_data({"domains": [{"domain": "a.test", "approvals": [{}, {"name": "n"}],
                                                "download_content_types": ["Text/*"]}]}).domains[0]
    assert [a.name for a in rule.approvals] == ["a.test#0", "n"] and rule.approvals[0].timeout_s == 300
    # A policy survives its own round trip (the control plane sends it to the node as JSON): the default
    # names it gave its rules ("<domain>#<index>", wildcards too) parse again.
    named = EgressPolicy.from_data({"domains": [{"domain": "*.a.test", "approvals": [{}, {}]}]})
    again = EgressPolicy.from_data(json.loads(named.to_json()))
    assert [a.name for a in again.domains[0].approvals] == ["*.a.test#0", "*.a.test#1"]
    with pytest.raises(PolicyError, match="approval rule name"):
        EgressPolicy.from_data({"domains": [{"domain": "a.test", "approvals": [{"name": "Bad Name"}]}]})
    assert rule.allows_download("text/plain; charset=utf-8") and not rule.allows_download(None)
    assert not rule.allows_download("application/json")


async def test_held_requests_per_sandbox_are_capped(world: tuple[World, list[dict[str, object]]]) -> None:
    from capsa.node.egress.approval_hold import PENDING_PER_SANDBOX

    w, _ = world
    calls = [asyncio.create_task(_send(w.port, "POST", f"/v1/charges/{i}", b"{}"))
             for i in range(PENDING_PER_SANDBOX)]
    held = await w.pending(PENDING_PER_SANDBOX)
    over = await _send(w.port, "POST", "/v1/charges/over", b"{}")
    assert over.status == 429 and b"requests of this sandbox await approval" in over.body
    for approval in held:
        w.broker.approvals.decide(approval.id, approve=False, decided_by="key_d")
    assert {r.status for r in await asyncio.gather(*calls)} == {403}
    assert w.sbx is not None and w.sbx.budget is not None and w.sbx.budget.used == 0  # held bodies released

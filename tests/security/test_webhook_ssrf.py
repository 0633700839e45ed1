"""Approval webhooks are not a way into the node's network (issue 27, M1).

A policy's ``approval_webhook`` naming a metadata, loopback or RFC 1918 address, literally or through a name
that resolves there, is refused when the session is created (``destination_refused``); a name that
resolved to a public address when the policy was set and to loopback when the notice is sent is not
connected to (the address is screened and pinned per connection). A burst of held requests makes a bounded
number of POSTs, over one connection of one shared client, each signed with the deployment's key.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
import pytest

from capsa.common.egress_policy import EgressPolicy
from capsa.common.webhook_signature import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.trust_store import TrustStore
from capsa.node.egress.webhooks import WebhookNotifier
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.api_stack import ApiStack
from tests.support.h11_server import Answer, h11_handler
from tests.support.problems import assert_problem
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(120)

KEY = base64.b64encode(os.urandom(32)).decode()
SIGNING_KEY = secrets.token_bytes(32)
TRUST = TrustStore(bundle="/tmp/capsa-trust/ca-certificates.crt", ca_file="/tmp/capsa-trust/capsa-egress.crt")
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]
NAMES = {
    "api.test": ["127.0.0.1"],
    "metadata.hooks.test": ["169.254.169.254"],
    "lan.hooks.test": ["10.0.0.1"],
    "mixed.hooks.test": ["93.184.216.34", "192.168.1.10"],  # one bad answer taints the set
    "public.hooks.test": ["93.184.216.34"],
}


@dataclass
class Receiver:
    """A real loopback HTTP receiver that counts TCP connections and keeps every request; while ``hold`` is
    clear it does not answer (a slow receiver), so notices pile up behind the first POST."""

    connections: int = 0
    requests: list[tuple[dict[bytes, bytes], bytes]] = field(default_factory=list)
    hold: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        head: h11.Request | None = None
        body = b""
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(ev, h11.Request):
                    head, body = ev, b""
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    assert head is not None
                    self.requests.append(({k.lower(): v for k, v in head.headers}, body))
                    await self.hold.wait()
                    writer.write((conn.send(h11.Response(status_code=204, headers=[])) or b"")
                                 + (conn.send(h11.EndOfMessage()) or b""))
                    await writer.drain()
                    conn.start_next_cycle()
                else:
                    return
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()

    def approvals(self) -> list[str]:
        return [a["id"] for _, body in self.requests for a in json.loads(body)["approvals"]]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    r.server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
    yield r
    r.hold.set()
    r.server.close()


def _ok(_request: h11.Request, _body: bytes) -> Answer:
    return 200, [], b"ok"


async def _until(check: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables")
async def test_webhook_to_internal_addresses_is_refused_when_the_session_is_created(
        make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    egress = NodeEgress.create(netns_prefix=f"cwh{secrets.token_hex(3)}-", resolver=StaticResolver(NAMES))
    stack = await make_stack(settings={"secret_key": KEY}, egress=egress, trust=TRUST)
    stack.replicas[0].app.state.plane.resolver = StaticResolver(NAMES)
    key = await stack.tenant_key("acme")
    refused = ["http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:2375/hook",
               "http://10.0.0.1:2375/containers", "http://[::ffff:127.0.0.1]/hook", "http://0x7f.1/hook",
               "http://metadata.hooks.test/", "https://lan.hooks.test/hook", "https://mixed.hooks.test/"]
    async with stack.client(key) as api:
        for url in refused:
            held = [{"domain": "api.test", "approvals": [{"name": "pay"}]}]
            policy = {"approval_webhook": url, "domains": held}
            created = await api.post("/v1/sessions", json={"policy": policy})
            body = assert_problem(created, 422, "destination_refused")
            assert "approval_webhook" in body["detail"], body
        # A webhook on a public name is accepted (and nothing above left a session running).
        ok = await api.post("/v1/sessions", json={"policy": {
            "approval_webhook": "https://public.hooks.test/hook", "domains": [{"domain": "api.test"}]}})
        assert ok.status_code == 201, ok.text
        items = (await api.get("/v1/sessions")).json()["items"]
        assert [s["id"] for s in items if s["state"] == "running"] == [ok.json()["id"]]


async def test_a_name_rebound_to_loopback_after_the_check_is_not_connected(
        receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    resolver = StaticResolver({"hooks.test": ["93.184.216.34"]})
    notifier = WebhookNotifier(resolver)
    url = f"http://hooks.test:{receiver.port}/hook"
    try:
        await notifier.check(url)  # public when the policy was set
        resolver.records["hooks.test"] = ["127.0.0.1"]  # ... and loopback when the notice goes out
        receiver.hold.set()
        with caplog.at_level(logging.WARNING, logger="capsa.node.egress.webhooks"):
            assert notifier.notify(url, {"id": "apr_1"})
            await _until(lambda: "approval webhook refused" in caplog.text, "the notice was refused")
        assert "127.0.0.1" in caplog.text
        assert receiver.connections == 0 and receiver.requests == []
    finally:
        await notifier.close()


async def test_a_burst_of_held_requests_makes_few_signed_posts_on_one_connection(receiver: Receiver) -> None:
    store = InMemorySecretStore(SecretBox(os.urandom(32)))
    upstream = await asyncio.start_server(h11_handler(_ok), "127.0.0.1", 0)
    resolver = StaticResolver({"api.test": ["127.0.0.1"], "hooks.test": ["127.0.0.1"]})
    notifier = WebhookNotifier(resolver, allow_networks=LOOPBACK, secret=SIGNING_KEY)
    broker = EgressBroker(secrets=store, sink=ListSink(), resolver=resolver, allow_networks=["127.0.0.0/8"],
                          upstream_http_port=int(upstream.sockets[0].getsockname()[1]), notifier=notifier)
    policy = EgressPolicy.from_data({
        "approval_webhook": f"http://hooks.test:{receiver.port}/hook",
        "domains": [{"domain": "api.test", "approvals": [{"timeout_s": 60}]}]})
    sbx = broker.register("sbx_burst", "127.0.0.1", policy, session_id="ses_burst")
    await broker.listen("sbx_burst", "127.0.0.1", ports=ServicePorts(http=0, tls=0, proxy=0, dns=0))
    port = int(sbx.bound["http"][1])
    held = 16  # PENDING_PER_SANDBOX: the most one sandbox may have waiting

    async def post(i: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/pay/{i} HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2\r\n"
                     "Connection: close\r\n\r\n{}".encode())
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data

    calls = [asyncio.create_task(post(i)) for i in range(held)]
    try:
        await _until(lambda: len(broker.approvals.list()) == held, f"{held} approvals pending")
        await _until(lambda: len(receiver.requests) >= 1, "the first notice reached the receiver")
        receiver.hold.set()  # the receiver answers now: what queued meanwhile goes out coalesced
        ids = {a.id for a in broker.approvals.list()}
        await _until(lambda: set(receiver.approvals()) == ids, "every pending approval was notified")
        print(f"\n{held} held requests -> {len(receiver.requests)} POSTs over {receiver.connections} "
              f"connection(s)")
        assert sorted(receiver.approvals()) == sorted(ids)  # each notified once
        assert len(receiver.requests) <= 2 and receiver.connections == 1
        for headers, body in receiver.requests:
            assert verify(SIGNING_KEY, body, headers[TIMESTAMP_HEADER.lower().encode()].decode(),
                          headers[SIGNATURE_HEADER.lower().encode()].decode())
            assert not verify(b"another key", body, headers[TIMESTAMP_HEADER.lower().encode()].decode(),
                              headers[SIGNATURE_HEADER.lower().encode()].decode())
            assert json.loads(body)["type"] == "approval.pending"
        for approval in broker.approvals.list():
            broker.approvals.decide(approval.id, approve=True, decided_by="key_test")
        answers = await asyncio.gather(*calls)
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    finally:
        for c in calls:
            c.cancel()
        await broker.unregister("sbx_burst")
        await broker.close()
        upstream.close()

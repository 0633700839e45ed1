"""The broker in-process on loopback: TLS interception, strict address screening, identity by source,
live policy updates and clean unregistering. (The real namespace/tap/nftables path is covered by
tests/security/test_egress_battery.py.)"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import pytest

from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress import dnswire
from capsa.node.egress.audit import EgressEvent, ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.h11_server import Answer, h11_handler
from tests.support.resolvers import StaticResolver

ANY_PORTS = ServicePorts(http=0, tls=0, proxy=0, dns=0)


def _host_and_auth(request: h11.Request, _body: bytes) -> Answer:
    headers = dict(request.headers)
    return 200, [], b"host=" + headers[b"host"] + b" auth=" + headers.get(b"authorization", b"-")


_echo = h11_handler(_host_and_auth)


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sink = ListSink()
        self.store = InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_1": "REALSECRET-42"})
        self.world_ca = SandboxCA("world", ["api.test", "other.test"])
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

        def pick(obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
            obj.context = self.world_ca.server_context(name or "api.test")

        ctx.sni_callback = pick
        self.https = await asyncio.start_server(_echo, "127.0.0.1", 0, ssl=ctx)
        self.http = await asyncio.start_server(_echo, "127.0.0.1", 0)
        self.servers += [self.https, self.http]
        (self.tmp / "world.pem").write_bytes(self.world_ca.cert_pem)

    def broker(self, *, allow_loopback: bool = True) -> EgressBroker:
        return EgressBroker(
            secrets=self.store, sink=self.sink,
            resolver=StaticResolver({"api.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}),
            upstream_ssl=ssl.create_default_context(cafile=str(self.tmp / "world.pem")),
            allow_networks=["127.0.0.0/8"] if allow_loopback else [],
            upstream_http_port=self.http.sockets[0].getsockname()[1],
            upstream_https_port=self.https.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for s in self.servers:
            s.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    await w.start()
    yield w
    await w.close()


POLICY = EgressPolicy.from_data({
    "domains": [{"domain": "api.test"}],
    "secrets": [{"secret": "sec_1", "domain": "api.test", "header": "Authorization"}],
})


async def _tls_get(port: int, ca_pem: bytes, sni: str, host: str, headers: str = "") -> bytes:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=sni)
    writer.write(f"GET /x HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data


async def test_tls_interception_with_injection(world: World) -> None:
    broker = world.broker()
    sbx = broker.register("sbx_a", "127.0.0.1", POLICY, session_id="ses_a")
    await broker.listen("sbx_a", "127.0.0.1", ports=ANY_PORTS)
    try:
        ph = sbx.placeholder_for("sec_1")
        data = await _tls_get(sbx.bound["tls"][1], sbx.ca.cert_pem, "api.test", "api.test",
                              f"Authorization: Bearer {ph}\r\n")
        assert data.startswith(b"HTTP/1.1 200")
        assert b"auth=Bearer [REDACTED]" in data and b"REALSECRET" not in data
        ev = world.sink.find(kind="http", decision="allow")[-1]
        assert ev.secret_ids == ["sec_1"] and ev.session_id == "ses_a"
    finally:
        await broker.close()


async def test_failed_client_handshake_is_audited(world: World) -> None:
    """A client that refuses the session CA (or stalls) mid-handshake leaves an audit event with the
    reason, not a silently dropped connection."""
    broker = world.broker()
    sbx = broker.register("sbx_h", "127.0.0.1", POLICY, session_id="ses_h")
    await broker.listen("sbx_h", "127.0.0.1", ports=ANY_PORTS)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            await _tls_get(sbx.bound["tls"][1], world.world_ca.cert_pem, "api.test", "api.test")
        for _ in range(100):
            if world.sink.find(kind="tls", decision="error"):
                break
            await asyncio.sleep(0.02)
        (ev,) = world.sink.find(kind="tls", decision="error")
        assert ev.destination == "api.test" and ev.session_id == "ses_h"
        assert ev.reason is not None and "TLS handshake with the sandbox's client failed" in ev.reason
        assert not world.sink.find(kind="http")
    finally:
        await broker.close()


async def test_default_refuses_loopback_answers(world: World) -> None:
    broker = world.broker(allow_loopback=False)
    sbx = broker.register("sbx_b", "127.0.0.1", POLICY)
    await broker.listen("sbx_b", "127.0.0.1", ports=ANY_PORTS)
    try:
        data = await _tls_get(sbx.bound["tls"][1], sbx.ca.cert_pem, "api.test", "api.test")
        assert data.startswith(b"HTTP/1.1 403")
        ev = world.sink.find(kind="http", decision="deny")[-1]
        assert ev.reason == "api.test resolves to a non-public address (127.0.0.1)"
    finally:
        await broker.close()


async def test_connection_from_another_address_refused(world: World) -> None:
    broker = world.broker()
    sbx = broker.register("sbx_c", "127.0.0.2", POLICY)
    await broker.listen("sbx_c", "127.0.0.1", ports=ANY_PORTS)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sbx.bound["http"][1])
        writer.write(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        try:
            data = await reader.read()
        except ConnectionResetError:
            data = b""
        writer.close()
        assert data == b""  # closed without an answer
        assert world.sink.find(kind="http", decision="deny", source="127.0.0.1")
    finally:
        await broker.close()


async def test_dns_stub_over_loopback(world: World) -> None:
    broker = world.broker()
    sbx = broker.register("sbx_d", "127.0.0.1", POLICY)
    await broker.listen("sbx_d", "127.0.0.1", ports=ANY_PORTS)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            loop = asyncio.get_running_loop()
            for name, rcode, answers in (("api.test", 0, ["127.0.0.1"]), ("evil.test", 3, [])):
                await loop.sock_sendto(s, dnswire.build_query(5, name), sbx.bound["dns"])
                reply = await asyncio.wait_for(loop.sock_recv(s, 512), 2)
                assert dnswire.parse_a_answers(reply, 5, name) == (rcode, answers)
            await loop.sock_sendto(s, b"\x00\x05garbage", sbx.bound["dns"])
            reply = await asyncio.wait_for(loop.sock_recv(s, 512), 2)
            assert reply[3] & 0x0F == 1  # FORMERR, and the stub keeps serving
        decisions = [(e.destination, e.decision) for e in world.sink.events if e.kind == "dns"]
        assert decisions == [("api.test", "allow"), ("evil.test", "deny")]
    finally:
        await broker.close()


async def test_dns_flood_is_limited_and_summarised(world: World) -> None:
    broker = world.broker()
    sbx = broker.register("sbx_dns", "127.0.0.1", POLICY)
    await broker.listen("sbx_dns", "127.0.0.1", ports=ANY_PORTS)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            loop = asyncio.get_running_loop()
            rcodes = []
            for i in range(600):
                await loop.sock_sendto(s, dnswire.build_query(i, f"x{i}.exfil.test"), sbx.bound["dns"])
                reply = await asyncio.wait_for(loop.sock_recv(s, 512), 2)
                rcodes.append(reply[3] & 0x0F)
        assert rcodes.count(dnswire.NXDOMAIN) >= 200 and rcodes.count(dnswire.REFUSED) >= 100
        summaries = [e for e in world.sink.events if e.reason == "DNS query rate limit exceeded"]
        assert 1 <= len(summaries) <= 6  # not one audit event per flooded query
    finally:
        await broker.close()


async def test_policy_update_and_unregister(world: World) -> None:
    broker = world.broker()
    sbx = broker.register("sbx_e", "127.0.0.1", POLICY)
    await broker.listen("sbx_e", "127.0.0.1", ports=ANY_PORTS)
    port = sbx.bound["tls"][1]
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await _tls_get(port, sbx.ca.cert_pem, "other.test", "other.test")
    update = broker.update_policy("sbx_e", EgressPolicy.from_data({"domains": [{"domain": "other.test"}]}))
    assert update.ca_reissued and sbx.placeholders == {}
    assert (await _tls_get(port, update.ca_pem, "other.test", "other.test")).startswith(b"HTTP/1.1 200")
    await broker.unregister("sbx_e")
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_failing_audit_sink_does_not_break_requests(world: World) -> None:
    def bad_sink(_e: EgressEvent) -> None:
        raise RuntimeError("sink down")

    broker = world.broker()
    broker.sink = bad_sink
    sbx = broker.register("sbx_f", "127.0.0.1", POLICY)
    await broker.listen("sbx_f", "127.0.0.1", ports=ANY_PORTS)
    try:
        assert (await _tls_get(sbx.bound["tls"][1], sbx.ca.cert_pem, "api.test", "api.test")
                ).startswith(b"HTTP/1.1 200")
    finally:
        await broker.close()


async def test_register_twice_and_unknown(world: World) -> None:
    broker = world.broker()
    broker.register("sbx_g", "127.0.0.1", POLICY)
    with pytest.raises(Exception, match="already registered"):
        broker.register("sbx_g", "127.0.0.1", POLICY)
    with pytest.raises(Exception, match="unknown sandbox"):
        broker.update_policy("sbx_nope", POLICY)
    with pytest.raises(ValueError):
        broker.register("sbx_h", "not-an-ip", POLICY)
    await broker.close()


async def test_client_hello_arriving_before_the_200_is_not_lost(world: World) -> None:
    """A ClientHello that reaches the broker after the CONNECT was read but before TLS took over the
    connection (here: sent while a slow leaf is issued; under load: read while the 200 drains) is handed
    to TLS, not left in the plain-text reader's buffer where the handshake would wait for it forever."""
    broker = world.broker()
    sbx = broker.register("sbx_t", "127.0.0.1", POLICY)
    await broker.listen("sbx_t", "127.0.0.1", ports=ANY_PORTS)
    issue = sbx.ca.context_for

    async def slow_issue(name: str) -> ssl.SSLContext:
        await asyncio.sleep(0.5)
        return await issue(name)

    sbx.ca.context_for = slow_issue  # type: ignore[method-assign]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sbx.bound["proxy"][1])
        writer.write(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # the broker has read the CONNECT and waits for the leaf
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ssl.create_default_context(cadata=sbx.ca.cert_pem.decode()).wrap_bio(
            incoming, outgoing, server_hostname="api.test")

        def step() -> bool:
            try:
                tls.do_handshake()
                return True
            except ssl.SSLWantReadError:
                return False

        step()
        writer.write(outgoing.read())  # the ClientHello, before the 200 has arrived
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200"), head
        done = False
        while not done:
            incoming.write(await asyncio.wait_for(reader.read(65536), 5))
            done = step()
            writer.write(outgoing.read())
        tls.write(b"GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
        writer.write(outgoing.read())
        answer, closed = b"", False
        while not closed:  # until the broker's close_notify (Connection: close)
            incoming.write(await asyncio.wait_for(reader.read(65536), 5))
            try:
                while data := tls.read(65536):
                    answer += data
                closed = True  # b"": the close_notify
            except ssl.SSLWantReadError:
                continue
            except ssl.SSLZeroReturnError:
                closed = True
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        await broker.close()


async def test_connect_tunnel_with_tls_and_injection(world: World) -> None:
    """CONNECT, then TLS inside the tunnel: the leaf is issued (off the loop) before the 200, so the
    ClientHello that follows at once is not lost."""
    broker = world.broker()
    sbx = broker.register("sbx_t", "127.0.0.1", POLICY)
    await broker.listen("sbx_t", "127.0.0.1", ports=ANY_PORTS)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sbx.bound["proxy"][1])
        writer.write(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        ctx = ssl.create_default_context(cadata=sbx.ca.cert_pem.decode())
        await asyncio.wait_for(writer.start_tls(ctx, server_hostname="api.test"), 5)
        ph = sbx.placeholder_for("sec_1")
        writer.write(f"GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {ph}\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert data.startswith(b"HTTP/1.1 200") and b"auth=Bearer [REDACTED]" in data
        assert sbx.ca.issued == 1
    finally:
        await broker.close()

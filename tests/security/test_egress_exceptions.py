"""Controlled exceptions to egress's public-only rule (issue 27), attacked at the broker, in-process on
loopback (no VM): the operator's internal networks (``CAPSA_EGRESS_ALLOW_NETWORKS``) open only to sandboxes
whose tenant is granted them, never open metadata, loopback or the node's own addresses implicitly, and an
upstream proxy (``CAPSA_EGRESS_UPSTREAM_PROXY``, a real CONNECT proxy here) carries every connection to
the address the broker pinned, after every policy check, without its credentials reaching the sandbox or
the audit trail. The whole path through ``capsa serve`` and a VM is in
tests/integration/test_serve_egress_exceptions.py.

Loopback plays the internal network: the upstream listens on 127.0.0.2 and the operator lists 127.0.0.0/8
explicitly (a loopback range is opened only by an entry inside it). The proxy listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import h11
import pytest

from capsa.common.addresses import node_addresses
from capsa.common.egress_networks import EgressNetworkSettings, UpstreamProxy, parse_networks
from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.internal_networks import InternalNetworks
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.connect_proxy import ConnectProxy
from tests.support.h11_server import Answer, h11_handler
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(120)

ANY = ServicePorts(http=0, tls=0, proxy=0, dns=0)
UPSTREAM = "127.0.0.2"
PROXY_PASSWORD = "pr0xy:pa$$-" + os.urandom(6).hex()
POLICY = EgressPolicy.from_data({"domains": [
    {"domain": "mirror.corp"}, {"domain": "meta.corp"}, {"domain": "self.corp"}, {"domain": "mixed.corp"},
    {"domain": "proxy.corp"}]})


def _answer(request: h11.Request, _body: bytes) -> Answer:
    return 200, [], b"mirror says hi to " + dict(request.headers)[b"host"]


class Upstreams:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = SandboxCA("world", ["mirror.corp"])
        self.connections = 0
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        handler = h11_handler(_answer)

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await handler(reader, writer)

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

        def pick(obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
            obj.context = self.ca.server_context(name or "mirror.corp")

        ctx.sni_callback = pick
        self.https = await asyncio.start_server(counted, UPSTREAM, 0, ssl=ctx)
        self.http = await asyncio.start_server(counted, UPSTREAM, 0)
        self.servers = [self.https, self.http]
        (self.tmp / "world.pem").write_bytes(self.ca.cert_pem)

    def broker(self, *, networks: str = "127.0.0.0/8", proxy: UpstreamProxy | None = None,
               sink: ListSink | None = None) -> EgressBroker:
        own = _own_non_loopback()[:1] or ["192.0.2.1"]
        return EgressBroker(
            secrets=InMemorySecretStore(SecretBox(os.urandom(32))), sink=sink or ListSink(),
            resolver=StaticResolver({"mirror.corp": [UPSTREAM], "meta.corp": ["169.254.169.254"],
                                     "self.corp": own, "mixed.corp": [UPSTREAM, "10.99.0.1"],
                                     "proxy.corp": ["127.0.0.1"]}),
            upstream_ssl=ssl.create_default_context(cafile=str(self.tmp / "world.pem")),
            internal=InternalNetworks(parse_networks(networks)), upstream_proxy=proxy,
            upstream_http_port=self.http.sockets[0].getsockname()[1],
            upstream_https_port=self.https.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for s in self.servers:
            s.close()


def _own_non_loopback() -> list[str]:
    return [str(a) for a in node_addresses() if not a.is_loopback and a.version == 4]


@pytest.fixture
async def upstreams(tmp_path: Path) -> AsyncIterator[Upstreams]:
    u = Upstreams(tmp_path)
    await u.start()
    yield u
    await u.close()


async def _sandbox(broker: EgressBroker, sid: str, networks: list[str]) -> SandboxEgress:
    sbx = broker.register(sid, "127.0.0.1", POLICY, session_id=f"ses_{sid}", networks=networks)
    await broker.listen(sid, "127.0.0.1", ports=ANY)
    return sbx


async def _http(sbx: SandboxEgress, host: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", sbx.bound["http"][1])
    writer.write(f"GET /pool/x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return data


async def _https(sbx: SandboxEgress, host: str) -> bytes:
    ctx = ssl.create_default_context(cadata=sbx.ca.cert_pem.decode())
    reader, writer = await asyncio.open_connection("127.0.0.1", sbx.bound["tls"][1], ssl=ctx,
                                                   server_hostname=host)
    writer.write(f"GET /pool/x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return data


async def test_an_internal_network_opens_only_to_a_granted_tenant(upstreams: Upstreams) -> None:
    sink = ListSink()
    broker = upstreams.broker(sink=sink)
    try:
        ungranted = await _sandbox(broker, "sbx_other", [])
        granted = await _sandbox(broker, "sbx_acme", ["127.0.0.0/8"])
        narrow = await _sandbox(broker, "sbx_narrow", ["10.0.0.0/8"])  # a grant that does not cover it
        for sbx in (ungranted, narrow):
            refused = await _http(sbx, "mirror.corp")
            assert refused.startswith(b"HTTP/1.1 403"), refused
            assert b"internal network this session's tenant is not granted" in refused
        assert upstreams.connections == 0  # refused before any connection was made
        ev = sink.find(kind="http", decision="deny")[-1]
        assert ev.destination == "mirror.corp" and ev.detail == {"internal_network": "not_granted"}
        assert (await _http(granted, "mirror.corp")).endswith(b"mirror says hi to mirror.corp")
        assert (await _https(granted, "mirror.corp")).endswith(b"mirror says hi to mirror.corp")
        assert upstreams.connections == 2
        allowed = sink.find(kind="http", decision="allow")
        assert [e.resolved_ip for e in allowed] == [UPSTREAM, UPSTREAM]
        # A grant taken away (the control plane re-sends the policy with the tenant's grants) holds at once.
        broker.update_policy("sbx_acme", POLICY, networks=[])
        assert (await _http(granted, "mirror.corp")).startswith(b"HTTP/1.1 403")
    finally:
        await broker.close()


async def test_the_allow_list_never_opens_metadata_loopback_or_the_node_implicitly(
        upstreams: Upstreams) -> None:
    """An operator that opens everything (``0.0.0.0/0``) to a tenant granted everything still does not open
    the metadata service, loopback or the node's own addresses; one answer among several taints all."""
    broker = upstreams.broker(networks="0.0.0.0/0")
    try:
        sbx = await _sandbox(broker, "sbx_all", ["0.0.0.0/0"])
        for host in ("meta.corp", "mirror.corp", *(["self.corp"] if _own_non_loopback() else [])):
            refused = await _http(sbx, host)
            assert refused.startswith(b"HTTP/1.1 403"), (host, refused)
            assert b"do not name explicitly" in refused, (host, refused)
        mixed = await _http(sbx, "mixed.corp")  # 127.0.0.2 (protected) with 10.99.0.1 (open)
        assert mixed.startswith(b"HTTP/1.1 403")
        assert upstreams.connections == 0
    finally:
        await broker.close()
    # Named explicitly, each opens (the decision, without connecting anywhere).
    own = ipaddress.ip_address("192.0.2.10")
    explicit = InternalNetworks(parse_networks("169.254.169.254/32, 127.0.0.0/8, 192.0.2.10/32"))
    wide = InternalNetworks(parse_networks("169.254.0.0/16, 0.0.0.0/0"))
    everything = [ipaddress.ip_network("0.0.0.0/0")]
    for address in ("169.254.169.254", "127.0.0.2", "192.0.2.10"):
        assert explicit.verdict(address, everything, own=frozenset({own})) == "allowed"
    assert wide.verdict("169.254.169.254", everything, own=frozenset()) == "allowed"
    assert wide.verdict("192.0.2.10", everything, own=frozenset({own})) == "protected"
    assert wide.verdict("127.0.0.1", everything, own=frozenset()) == "protected"
    assert explicit.verdict("10.0.0.1", everything, own=frozenset()) == "refused"


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[ConnectProxy, UpstreamProxy]]:
    p = ConnectProxy(auth=f"capsa:{PROXY_PASSWORD}")
    port = await p.start("127.0.0.1")
    yield p, UpstreamProxy.parse(f"http://capsa:{quote(PROXY_PASSWORD, safe='')}@127.0.0.1:{port}")
    await p.stop()


async def test_through_the_upstream_proxy_after_every_check(
        upstreams: Upstreams, proxy: tuple[ConnectProxy, UpstreamProxy],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tunnels, settings = proxy
    sink = ListSink()
    broker = upstreams.broker(proxy=settings, sink=sink)
    wanted = "Basic " + base64.b64encode(f"capsa:{PROXY_PASSWORD}".encode()).decode()
    try:
        granted = await _sandbox(broker, "sbx_acme", ["127.0.0.0/8"])
        other = await _sandbox(broker, "sbx_other", [])
        # Refused by policy, by the grant, or naming the proxy itself: the proxy never hears of it.
        assert (await _http(granted, "evil.test")).startswith(b"HTTP/1.1 403")
        assert (await _http(other, "mirror.corp")).startswith(b"HTTP/1.1 403")
        proxied = await _http(granted, "proxy.corp")
        assert proxied.startswith(b"HTTP/1.1 403") and b"upstream proxy" in proxied
        assert tunnels.connections == 0 and upstreams.connections == 0

        # Allowed: HTTPS and plain HTTP each go through a CONNECT to the pinned address, never directly.
        assert (await _https(granted, "mirror.corp")).endswith(b"mirror says hi to mirror.corp")
        assert (await _http(granted, "mirror.corp")).endswith(b"mirror says hi to mirror.corp")
        https_port = upstreams.https.sockets[0].getsockname()[1]
        http_port = upstreams.http.sockets[0].getsockname()[1]
        assert [(t.target, t.status, t.authorization) for t in tunnels.tunnels] == [
            (f"{UPSTREAM}:{https_port}", 200, wanted), (f"{UPSTREAM}:{http_port}", 200, wanted)]
        assert upstreams.connections == 2 == tunnels.connections

        # A proxy that refuses: the sandbox gets a 502 naming the status, not the proxy's answer.
        tunnels.auth = "capsa:other"
        refused = await _http(granted, "mirror.corp")
        assert refused.startswith(b"HTTP/1.1 502") and b"refused the tunnel (407)" in refused
        assert b"hunter2" not in refused
    finally:
        await broker.close()
    # The credentials are in no audit event, no response and no log line.
    seen = repr(sink.events) + caplog.text + repr(settings) + str(settings)
    for form in (PROXY_PASSWORD, wanted, wanted.split()[1]):
        assert form not in seen


def test_settings_parse_and_never_show_the_proxy_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_EGRESS_ALLOW_NETWORKS", "10.20.0.0/16, 192.168.5.7/32 fd00::/8")
    monkeypatch.setenv("CAPSA_EGRESS_UPSTREAM_PROXY", "https://u:s3cr3t-pw@proxy.corp:3129")
    settings = EgressNetworkSettings()
    assert [str(n) for n in settings.allow_networks] == ["10.20.0.0/16", "192.168.5.7/32", "fd00::/8"]
    proxy = settings.proxy()
    assert proxy is not None and (proxy.scheme, proxy.host, proxy.port) == ("https", "proxy.corp", 3129)
    assert proxy.authorization == b"Basic " + base64.b64encode(b"u:s3cr3t-pw")
    assert "s3cr3t" not in repr(settings) + repr(proxy) + str(proxy)
    monkeypatch.setenv("CAPSA_EGRESS_UPSTREAM_PROXY", "socks5://u:s3cr3t-pw@proxy.corp:1080")
    with pytest.raises(ValueError) as bad:
        EgressNetworkSettings()
    assert "s3cr3t" not in str(bad.value)
    monkeypatch.setenv("CAPSA_EGRESS_UPSTREAM_PROXY", "")
    monkeypatch.setenv("CAPSA_EGRESS_ALLOW_NETWORKS", "10.0.0.1/8")
    with pytest.raises(ValueError, match="host bits"):
        EgressNetworkSettings()

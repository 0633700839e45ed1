"""The egress broker: the only way out of a sandbox, one per node.

For every sandbox the broker listens inside the sandbox's network namespace on the gateway address:
plain HTTP (TCP 80 DNAT-ed here), TLS (TCP 443 DNAT-ed here, terminated with the sandbox's own CA after
reading SNI), an explicit proxy (CONNECT and absolute-form HTTP) and the DNS stub. A connection's listener
tells which sandbox it belongs to; its source address must also be the sandbox's guest address.

For each request the broker checks the policy, resolves the destination itself, refuses non-public
answers, pins the address for the connection, swaps placeholders for secrets where a binding allows it,
verifies the upstream certificate, redacts secrets from the response and writes one audit event.

Bodies stream in both directions (injection touches headers only; redaction of a bound destination's
response works on a bounded sliding window, see redaction.py). What one sandbox and the node may hold —
connections, descriptors, buffered bytes, time — is in limits.py. The exception: a request an approval rule
may match is read whole (within the request limit, charged to the buffer budget) and held, unforwarded,
until it is approved, denied, timed out or its sandbox stops (approvals.py, docs/approvals.md). Per-domain
upload bans and download content-type lists are checked on the request's size and the response's head.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import socket
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import h11

from capsa.common.addresses import is_ip_literal, is_public_address
from capsa.common.destinations import DestinationRefused, screen_host
from capsa.common.egress_networks import IPNetwork, UpstreamProxy
from capsa.common.errors import CapsaError
from capsa.node.egress import dnswire
from capsa.node.egress.approvals import (
    PENDING_PER_SANDBOX,
    PREVIEW_BYTES,
    Approval,
    ApprovalBook,
    new_approval_id,
)
from capsa.node.egress.audit import AuditSink, EgressEvent, emit_safely
from capsa.node.egress.ca import SandboxCA, leaf_name
from capsa.node.egress.clienthello import MAX_HELLO, UNRECOGNIZED_NAME_ALERT, Hello, parse_client_hello
from capsa.node.egress.dns import DnsAnswer, DnsServerProtocol, ResolveError, Resolver, SystemResolver
from capsa.node.egress.internal_networks import InternalNetworks
from capsa.node.egress.limits import BrokerLimits, ByteBudget, Pace
from capsa.node.egress.policy import ApprovalRule, DomainRule, EgressPolicy, SecretBinding
from capsa.node.egress.redaction import SecretLeak, SecretPatterns, StreamRedactor
from capsa.node.egress.secrets import SecretStore, is_placeholder, new_placeholder
from capsa.node.egress.token_injection import TokenRefused, TokenRequest, inject_tokens
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.egress.upstream_proxy import ProxyAddresses, ProxyRefused, open_tunnel
from capsa.node.egress.webhooks import Notifier, WebhookNotifier
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
DNS_QUERIES_PER_SECOND = 100
_APPROVAL_ACTIONS = {"pending": "requested", "approved": "approved", "denied": "denied",
                     "timeout": "timed_out", "cancelled": "cancelled"}
"""The ``action`` of an approval event (its ``detail``), by the approval's state."""
_STREAM_LIMIT = 64 * 1024
_SMALL_BODY = 256 * 1024
"""A bound destination's response up to this declared length is redacted whole and keeps a length."""


def _until(deadline: float) -> Callable[[], float]:
    """Seconds left before ``deadline`` (monotonic), as the read timeouts of one whole phase."""
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        return remaining
    return left


def _where(exc: BaseException) -> str:
    """Where an exception was raised (file:line), for a log line that must not quote its message: h11's and
    ssl's messages can hold header values, and header values can hold secrets."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


class BrokerError(CapsaError):
    code = "egress_error"
    status = 500


class _Deny(Exception):
    """A request the broker refuses: answered with ``status`` and audited with ``reason``; ``body`` (when
    given) is answered as JSON instead of the plain-text reason."""

    def __init__(self, status: int, reason: str, *, rule: str | None = None, close: bool = True,
                 body: dict[str, Any] | None = None, detail: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.rule, self.close = status, reason, rule, close
        self.body, self.detail = body, detail


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
    budget: ByteBudget | None = None
    """The bytes this sandbox's transfers may buffer at once (charged to the node's budget too)."""
    accept_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    listen_socks: list[socket.socket] = field(default_factory=list)
    patterns: SecretPatterns | None = None
    """Redaction forms of the secrets this sandbox binds; built on first use, dropped on policy change."""
    patterns_tokens: int = -1
    """The token generation (ConnectionTokens.generation) ``patterns`` was built at."""
    granted: tuple[IPNetwork, ...] = ()
    """The networks its tenant was granted: of the node's internal networks, the ones it may reach."""

    @property
    def placeholder_env(self) -> dict[str, str]:
        """Environment variables to set in the guest: ``binding.env`` → placeholder."""
        return {b.env: ph for ph, b in self.placeholders.items() if b.env}

    def placeholder_for(self, secret_id: str) -> str | None:
        for ph, b in self.placeholders.items():
            if b.secret == secret_id:
                return ph
        return None


_is_ip_literal = is_ip_literal


def _assign(policy: EgressPolicy, current: Mapping[str, SecretBinding],
            given: Mapping[str, str]) -> dict[str, SecretBinding]:
    """placeholder -> binding for ``policy``: a binding keeps the placeholder its secret has in
    ``current``, else takes the one ``given`` for its secret, else a new one. A secret bound twice gets
    one placeholder per binding (the given one goes to the first)."""
    out: dict[str, SecretBinding] = {}
    for binding in policy.secrets:
        old = next((ph for ph, b in current.items() if b.secret == binding.secret and ph not in out), None)
        wanted = given.get(binding.secret)
        if old is None and wanted is not None and wanted not in out:
            if not is_placeholder(wanted):
                raise BrokerError(f"not a placeholder for {binding.secret}", code="bad_request", status=422)
            old = wanted
        out[old or new_placeholder()] = binding
    return out


def _networks(cidrs: Sequence[str]) -> tuple[IPNetwork, ...]:
    try:
        return tuple(ipaddress.ip_network(c) for c in cidrs)
    except ValueError as exc:
        raise BrokerError(f"granted networks: {exc}", code="bad_request", status=422) from None


def _scrub(sbx: SandboxEgress, path: str) -> str:
    """The path as audited: bounded, and without placeholders (audit readers need not learn them)."""
    for ph in sbx.placeholders:
        path = path.replace(ph, "[PLACEHOLDER]")
    return path[:512]


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _Deny(400, "malformed port")
    return int(text)


def _split_host(value: str, default_port: int) -> tuple[str, int]:
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise _Deny(400, "malformed host")
        host, rest = value[1:end], value[end + 1:]
        return host, (_port(rest[1:]) if rest.startswith(":") else default_port)
    if value.count(":") == 1:
        host, _, p = value.partition(":")
        return host.rstrip("."), _port(p)
    if ":" in value:
        return value, default_port  # bare IPv6 literal; refused as an IP literal later
    return value.rstrip("."), default_port


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k == name]


def _grant_key(rule: DomainRule, approval: ApprovalRule) -> str:
    """What a ``session`` approval covers: this approval rule of this domain rule."""
    return f"{rule.domain}/{approval.name}"


def _printable(value: bytes, limit: int = 100) -> str:
    """A header value as it may appear in an audit reason: ASCII, printable, bounded."""
    text = value.decode("latin-1")[:limit]
    return "".join(c if " " <= c <= "~" else "?" for c in text)


class _Client:
    """The sandbox side of one connection, spoken with h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=32 * 1024)

    async def next_event(self, left: Callable[[], float]) -> h11.Event | type[h11.PAUSED]:
        """The next event; each read waits at most ``left()`` seconds (which raises once time is up)."""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(self.reader.read(_STREAM_LIMIT), left())
                self.conn.receive_data(data)
                continue
            return event  # type: ignore[return-value]

    async def send(self, *events: h11.Event, left: Callable[[], float] | None = None) -> None:
        # One write per response: fewer segments and TLS records.
        self.writer.write(b"".join(self.conn.send(ev) or b"" for ev in events))
        await asyncio.wait_for(self.writer.drain(), left() if left is not None else None)


class _Upstream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[str, str, int]
                 ) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)

    async def next_event(self, left: Callable[[], float]) -> h11.Event:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(self.reader.read(_STREAM_LIMIT), left())
                self.conn.receive_data(data)
                continue
            return event  # type: ignore[return-value]

    async def send(self, event: h11.Event, left: Callable[[], float]) -> None:
        try:
            data = self.conn.send(event) or b""
        except h11.LocalProtocolError:
            # Its message quotes the offending header value, which may hold a secret: never pass it on.
            raise _Deny(400, "request cannot be framed for the upstream") from None
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), left())

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
    connection_ids: list[str] = field(default_factory=list)
    bytes_out: int = 0
    approval_id: str | None = None
    """The approval that let the request through (None: none was needed)."""


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
        limits: BrokerLimits | None = None,
        approvals: ApprovalBook | None = None,
        notifier: Notifier | None = None,
        tokens: ConnectionTokens | None = None,
        internal: InternalNetworks | None = None,
        upstream_proxy: UpstreamProxy | None = None,
    ) -> None:
        """``allow_networks`` lets every sandbox's destinations resolve into otherwise refused ranges
        (private, loopback…): a seam for tests, which no setting reaches. ``internal`` holds the operator's
        ``CAPSA_EGRESS_ALLOW_NETWORKS``: a sandbox reaches them only where its tenant was granted them
        (``register(networks=)``). With ``upstream_proxy`` every upstream connection is a CONNECT tunnel
        through it, opened after every check. ``notifier`` sends a policy's ``approval_webhook``
        notifications (default: screened with this broker's resolver, no allow-list, unsigned)."""
        self.secrets = secrets
        self.sink = sink
        self.tokens = tokens if tokens is not None else ConnectionTokens()
        """Access tokens of the connections policies bind (fetched from the control plane)."""
        self.resolver: Resolver = resolver or SystemResolver()
        self.upstream_ssl = upstream_ssl or ssl.create_default_context()
        self.allow_networks = [ipaddress.ip_network(n) for n in allow_networks]
        self.internal = internal or InternalNetworks()
        self.upstream_proxy = upstream_proxy
        self._proxy_addresses = ProxyAddresses(upstream_proxy) if upstream_proxy is not None else None
        self.upstream_http_port = upstream_http_port
        self.upstream_https_port = upstream_https_port
        self.connect_timeout = connect_timeout
        self.limits = limits or BrokerLimits()
        self.connection_cap = self.limits.connection_cap()
        """Connections the node serves at once, all sandboxes together (bounded by RLIMIT_NOFILE)."""
        self.active = 0
        self.budget = ByteBudget(self.limits.buffer_bytes_total)
        self._sandboxes: dict[str, SandboxEgress] = {}
        self._sni: weakref.WeakKeyDictionary[ssl.SSLObject, str] = weakref.WeakKeyDictionary()
        self._tls_contexts: dict[str, ssl.SSLContext] = {}
        self.approvals = approvals or ApprovalBook()
        self.approvals.on_change = self._audit_approval
        self.notifier: Notifier = notifier if notifier is not None else WebhookNotifier(self.resolver)

    # -- sandbox lifecycle -------------------------------------------------------------------------

    def register(self, sandbox_id: str, guest_ip: str, policy: EgressPolicy, *,
                 session_id: str | None = None,
                 placeholders: Mapping[str, str] | None = None,
                 networks: Sequence[str] = ()) -> SandboxEgress:
        """``placeholders`` (secret id -> placeholder) are the session's own, recorded by the control plane
        (a restored or branched sandbox gets the ones its guest already holds); a binding without one gets
        a new random placeholder. ``networks``: the networks its tenant was granted (CIDRs)."""
        if sandbox_id in self._sandboxes:
            raise BrokerError(f"sandbox {sandbox_id} is already registered", code="conflict", status=409)
        ipaddress.ip_address(guest_ip)
        sbx = SandboxEgress(sandbox_id, session_id, guest_ip, policy,
                            SandboxCA(sandbox_id, [r.domain for r in policy.domains]))
        sbx.budget = ByteBudget(self.limits.buffer_bytes_per_sandbox, parent=self.budget)
        sbx.placeholders = _assign(policy, {}, placeholders or {})
        sbx.granted = _networks(networks)
        self._sandboxes[sandbox_id] = sbx
        self._tls_contexts[sandbox_id] = self._make_sni_context(sbx)
        return sbx

    def bound_connections(self) -> set[str]:
        """The connections some registered sandbox's policy binds."""
        return {c.connection for sbx in self._sandboxes.values() for c in sbx.policy.connections}

    def get(self, sandbox_id: str) -> SandboxEgress:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise BrokerError(f"unknown sandbox {sandbox_id}", code="not_found", status=404) from None

    def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                      placeholders: Mapping[str, str] | None = None,
                      networks: Sequence[str] | None = None) -> PolicyUpdate:
        """Replace a running sandbox's policy. Placeholders of bindings that remain keep their value;
        new bindings get the given placeholder or a new one (see ``placeholder_env``); removed ones stop
        working. ``networks`` (None: unchanged) replaces its tenant's granted networks."""
        sbx = self.get(sandbox_id)
        kept = _assign(policy, sbx.placeholders, placeholders or {})
        granted = sbx.granted if networks is None else _networks(networks)
        reissue = any(not sbx.ca.covers(r.domain[2:] if r.is_wildcard else r.domain) for r in policy.domains)
        sbx.policy = policy
        sbx.placeholders = kept
        sbx.granted = granted
        self._forget_patterns(sbx)
        sbx.buckets.clear()
        self.approvals.clear_grants(sandbox_id)  # session approvals were given under the old rules
        if reissue:
            # The TLS paths read sbx.ca on every handshake, so listeners pick the new CA up at once.
            sbx.ca = SandboxCA(sandbox_id, [r.domain for r in policy.domains])
        return PolicyUpdate(ca_reissued=reissue, ca_pem=sbx.ca.cert_pem)

    async def listen(self, sandbox_id: str, host: str, *, netns: str | None = None,
                     ports: ServicePorts | None = None) -> None:
        """Open the sandbox's listeners on ``host`` inside ``netns`` (``None``: this namespace)."""
        sbx = self.get(sandbox_id)
        ports = ports or ServicePorts()
        loop = asyncio.get_running_loop()
        try:
            modes: tuple[tuple[int, Mode], ...] = ((ports.http, "http"), (ports.proxy, "proxy"))
            for port, mode in modes:
                sock = await asyncio.to_thread(open_listener, netns, host, port)
                server = await asyncio.start_server(self._handler(sbx, mode), sock=sock, limit=_STREAM_LIMIT)
                sbx.servers.append(server)
                sbx.bound[mode] = server.sockets[0].getsockname()[:2]
            # TLS on the DNAT-ed port: the broker reads the ClientHello's name before the handshake starts,
            # so the leaf for it can be issued off the event loop (see _tls_connection).
            tls_sock = await asyncio.to_thread(open_listener, netns, host, ports.tls)
            tls_sock.setblocking(False)
            sbx.listen_socks.append(tls_sock)
            sbx.bound["tls"] = tls_sock.getsockname()[:2]
            sbx.accept_tasks.append(asyncio.create_task(self._accept_tls(sbx, tls_sock)))
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
        # Held requests are denied (their connections get the 403 if they are still there to read it).
        closed = self.approvals.cancel_sandbox(sandbox_id, "the sandbox stopped")
        waiters = [a.waiter for a in closed if a.waiter is not None]
        if waiters:
            await asyncio.wait(waiters, timeout=1.0)
        if sbx is None:
            return
        await self._close_listeners(sbx)
        sbx.placeholders.clear()
        self._forget_patterns(sbx)

    async def close(self) -> None:
        for sid in list(self._sandboxes):
            await self.unregister(sid)
        await self.notifier.close()

    @staticmethod
    def _forget_patterns(sbx: SandboxEgress) -> None:
        if sbx.patterns is not None:
            sbx.patterns = None
            sbx.patterns_tokens = -1
            re.purge()  # the compiled forms (which spell the secrets) also sit in re's cache

    async def _close_listeners(self, sbx: SandboxEgress) -> None:
        for server in sbx.servers:
            server.close()
        for accept in sbx.accept_tasks:
            accept.cancel()
        for sock in sbx.listen_socks:
            sock.close()
        for w in list(sbx.writers):
            w.close()
        for task in list(sbx.tasks):
            task.cancel()
        for server in sbx.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        if sbx.tasks or sbx.accept_tasks:
            await asyncio.gather(*sbx.tasks, *sbx.accept_tasks, return_exceptions=True)
        sbx.servers.clear()
        sbx.accept_tasks.clear()
        sbx.listen_socks.clear()
        if sbx.dns_transport is not None:
            sbx.dns_transport.close()
            sbx.dns_transport = None

    # -- audit -------------------------------------------------------------------------------------

    def _audit(self, sbx: SandboxEgress, **fields: object) -> None:
        emit_safely(self.sink, EgressEvent(session_id=sbx.session_id, sandbox_id=sbx.sandbox_id,
                                           **fields))  # type: ignore[arg-type]

    def _audit_handshake(self, sbx: SandboxEgress, host: str, exc: BaseException) -> None:
        """Allowed by policy, but the sandbox's client did not finish its side of the TLS handshake (it gave
        up, distrusts the session CA, or was too slow): on the record rather than dropped silently."""
        if isinstance(exc, TimeoutError):
            why = f"did not complete within {self.limits.head_timeout:g} s"
        else:
            why = f"failed: {exc.__class__.__name__}"
            if isinstance(exc, ssl.SSLError) and exc.reason:
                why += f" ({exc.reason})"
        self._audit(sbx, kind="tls", decision="error", source=sbx.guest_ip, destination=host[:255],
                    reason=f"the TLS handshake with the sandbox's client {why}")

    def _audit_approval(self, approval: Approval) -> None:
        """One ``approval`` event per transition: opened (pending), approved, denied, timed out, cancelled."""
        state = approval.state
        if state == "pending":
            reason = f"approval {approval.id} pending (rule {approval.approval_rule})"
        elif state == "timeout":
            reason = f"approval {approval.id} timed out"
        elif state == "cancelled":
            reason = f"approval {approval.id} cancelled: {approval.reason or ''}".rstrip(": ")
        else:
            reason = f"approval {approval.id} {state} by {approval.decided_by} (scope {approval.scope})"
            if approval.reason:
                reason += f": {approval.reason[:200]}"
        emit_safely(self.sink, EgressEvent(
            kind="approval", session_id=approval.session_id, sandbox_id=approval.sandbox_id,
            destination=approval.destination, method=approval.method, path=approval.path,
            decision="allow" if state == "approved" else "deny", rule=approval.rule, reason=reason,
            bytes_out=approval.body_bytes,
            detail={"action": _APPROVAL_ACTIONS[state], "approval_id": approval.id, "decision": state,
                    "decided_by": approval.decided_by,
                    "scope": approval.scope, "approval_rule": approval.approval_rule,
                    "reason": approval.reason, "expires_at": approval.expires_at}))

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

    @staticmethod
    def _tls_leaf(sbx: SandboxEgress, name: str | None) -> str | None:
        """The leaf name that serves ``name`` for this sandbox, or None when the name is refused."""
        host = (name or "").lower().rstrip(".")
        if not host or _is_ip_literal(host) or not sbx.ca.covers(host):
            return None
        rule = sbx.policy.rule_for(host)
        return None if rule is None else leaf_name(host, rule.is_wildcard)

    def _make_sni_context(self, sbx: SandboxEgress) -> ssl.SSLContext:
        """The context of TLS inside a CONNECT tunnel: the leaf is issued (off the loop) before the
        handshake starts, so the callback only looks it up."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])

        def on_sni(sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext
                   ) -> int | None:
            leaf = self._tls_leaf(sbx, name)
            leaf_ctx = sbx.ca.cached_context(leaf) if leaf is not None else None
            if leaf_ctx is None:
                self._audit(sbx, kind="tls", decision="deny", destination=name or "<no SNI>",
                            reason="TLS server name missing or not allowed by policy")
                return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
            sslobj.context = leaf_ctx
            if isinstance(sslobj, ssl.SSLObject) and name is not None:
                self._sni[sslobj] = name.lower().rstrip(".")
            return None

        ctx.sni_callback = on_sni
        return ctx

    async def _start_tls(self, sbx: SandboxEgress, client: _Client, host: str) -> str | None:
        ctx = self._tls_contexts.get(sbx.sandbox_id)
        leaf = self._tls_leaf(sbx, host)
        if ctx is None or leaf is None:
            return None
        try:
            # Nothing may be awaited before start_tls: a ClientHello read into the stream would be lost.
            # (_connect issued the leaf before answering the CONNECT.)
            await asyncio.wait_for(client.writer.start_tls(ctx), self.limits.head_timeout)
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError) as exc:
            self._audit_handshake(sbx, host, exc)
            return None
        sslobj = client.writer.get_extra_info("ssl_object")
        return self._sni.get(sslobj) if isinstance(sslobj, ssl.SSLObject) else None

    async def _accept_tls(self, sbx: SandboxEgress, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if sock.fileno() < 0:
                    return
                # EMFILE/ENFILE: the descriptor budget is spent; back off instead of spinning.
                _log.warning("egress TLS accept of %s failed: %s", sbx.sandbox_id, exc.__class__.__name__)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._tls_connection(sbx, conn))
            if not self._enter(sbx, task):
                task.cancel()
                conn.close()

    async def _peek_hello(self, conn: socket.socket, left: Callable[[], float]) -> Hello | None:
        """The connection's ClientHello, read without consuming it; None if it closed first."""
        loop = asyncio.get_running_loop()
        while True:
            ready: asyncio.Future[None] = loop.create_future()
            def wake(f: asyncio.Future[None] = ready) -> None:
                if not f.done():
                    f.set_result(None)

            loop.add_reader(conn.fileno(), wake)
            try:
                await asyncio.wait_for(ready, left())
            finally:
                loop.remove_reader(conn.fileno())
            try:
                data = conn.recv(MAX_HELLO, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            if not data:
                return None
            hello = parse_client_hello(data)
            if hello.complete:
                return hello
            # Part of a hello is queued: the socket stays readable until the rest comes, so wait a little.
            await asyncio.sleep(0.02)

    async def _tls_connection(self, sbx: SandboxEgress, conn: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        owned = False

        def close() -> None:
            # Once a transport owns the socket only the transport may close it: closing the fd under it
            # would let a new connection reuse the number while the transport still unregisters it.
            if writer is not None:
                writer.close()
            elif not owned:
                conn.close()

        async def run() -> None:
            nonlocal writer, owned
            try:
                source = str(conn.getpeername()[0])
            except OSError:
                return
            if source != sbx.guest_ip:
                self._audit(sbx, kind="tls", decision="deny", source=source,
                            reason="connection from an address that is not the sandbox's")
                return
            hello = await self._peek_hello(conn, _until(time.monotonic() + self.limits.head_timeout))
            if hello is None:
                return
            leaf = self._tls_leaf(sbx, hello.server_name) if hello.valid else None
            if leaf is None or hello.server_name is None:
                self._audit(sbx, kind="tls", decision="deny", source=source,
                            destination=(hello.server_name or "<no SNI>")[:255],
                            reason="TLS server name missing or not allowed by policy")
                with contextlib.suppress(OSError):
                    conn.send(UNRECOGNIZED_NAME_ALERT)
                return
            host = hello.server_name.lower().rstrip(".")
            ctx = await sbx.ca.context_for(leaf)
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=_STREAM_LIMIT, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            owned = True  # from here on the transport (or its failed handshake) closes the socket
            try:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=ctx, ssl_handshake_timeout=self.limits.head_timeout)
            except (TimeoutError, ssl.SSLError, OSError) as exc:
                self._audit_handshake(sbx, host, exc)
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            sbx.writers.add(writer)
            try:
                await self._serve(sbx, "tls", reader, writer, tls_host=host)
            finally:
                sbx.writers.discard(writer)

        await self._guarded(sbx, run, close)

    # -- connections -------------------------------------------------------------------------------

    def _enter(self, sbx: SandboxEgress, task: asyncio.Task[None]) -> bool:
        """Count a new connection against its sandbox's and the node's caps; False if either is full."""
        if len(sbx.tasks) >= self.limits.connections_per_sandbox:
            # Every connection costs descriptors and buffers: cap what one sandbox holds.
            self._audit(sbx, kind="http", decision="deny", reason="too many concurrent connections")
            return False
        if self.active >= self.connection_cap:
            self._audit(sbx, kind="http", decision="deny",
                        reason="the node's egress connection cap is reached")
            return False
        sbx.tasks.add(task)
        self.active += 1
        task.add_done_callback(lambda t: self._leave(sbx, t))
        return True

    def _leave(self, sbx: SandboxEgress, task: asyncio.Task[None]) -> None:
        if task in sbx.tasks:
            sbx.tasks.discard(task)
            self.active -= 1

    async def _guarded(self, sbx: SandboxEgress, run: Callable[[], Awaitable[None]],
                       close: Callable[[], None]) -> None:
        try:
            await run()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, h11.ProtocolError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            # Not the message: it can quote header values (see _where).
            _log.error("egress connection of %s failed: %s at %s", sbx.sandbox_id, exc.__class__.__name__,
                       _where(exc))
        finally:
            close()

    def _handler(self, sbx: SandboxEgress, mode: Mode
                 ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            if not self._enter(sbx, task):
                writer.close()
                return
            sbx.writers.add(writer)

            def close() -> None:
                sbx.writers.discard(writer)
                writer.close()

            await self._guarded(sbx, lambda: self._serve(sbx, mode, reader, writer), close)
            with contextlib.suppress(Exception):
                await writer.wait_closed()

        return handle

    async def _serve(self, sbx: SandboxEgress, mode: Mode, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, *, tls_host: str | None = None) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        if source != sbx.guest_ip:
            self._audit(sbx, kind="http", decision="deny", source=source,
                        reason="connection from an address that is not the sandbox's")
            return
        client = _Client(reader, writer)
        pinned: str | None = tls_host  # the one host this connection may talk to
        tls = tls_host is not None
        upstream: _Upstream | None = None
        first = True
        try:
            while True:
                # The whole request head within its deadline, however slowly its bytes come.
                wait = self.limits.head_timeout if first else self.limits.idle_timeout
                first = False
                try:
                    event = await client.next_event(_until(time.monotonic() + wait))
                except h11.RemoteProtocolError as exc:
                    self._audit(sbx, kind="http", decision="deny", source=source, destination=pinned,
                                status=400, reason=f"malformed HTTP: {str(exc)[:200]}")
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
                    sni = await self._start_tls(sbx, client, host)
                    if sni != host:
                        if sni is not None:
                            self._audit(sbx, kind="tls", decision="deny", source=source, destination=sni,
                                        reason=f"TLS server name does not match the CONNECT target {host}")
                        return
                    pinned, tls = host, True
                    client = _Client(reader, writer)
                    first = True
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
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(writer.drain(), self.limits.head_timeout)

    async def _connect(self, sbx: SandboxEgress, client: _Client, req: h11.Request, source: str
                       ) -> str | None:
        target = req.target.decode("latin-1")
        # Read nothing more until TLS takes over the transport: bytes the transport read now would land in
        # the StreamReader's buffer, which start_tls never hands to TLS, and the handshake would hang (a
        # ClientHello sent as soon as the 200 arrives could be read while we still await the drain or the
        # leaf). Paused, they wait in the socket; the loop's start_tls resumes reading under TLS.
        transport = client.writer.transport
        if isinstance(transport, asyncio.ReadTransport):  # typed as a WriteTransport; a socket's is both
            transport.pause_reading()
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
            self._audit(sbx, kind="connect", decision="deny", source=source, destination=target[:255],
                        method="CONNECT", status=deny.status, reason=deny.reason)
            await client.send(h11.Response(status_code=deny.status,
                                           headers=[(b"content-length", b"0"), (b"connection", b"close")]),
                              left=_until(time.monotonic() + self.limits.head_timeout))
            return None
        leaf = self._tls_leaf(sbx, host)
        if leaf is not None:
            await sbx.ca.context_for(leaf)  # before the 200: the client's ClientHello follows it at once
        await client.send(h11.Response(status_code=200, headers=[]),
                          left=_until(time.monotonic() + self.limits.head_timeout))
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
        body: bytes | None = None
        reserved = 0
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
                try:
                    th, tp = (parts.hostname or ""), (parts.port or self.upstream_http_port)
                except ValueError:  # a port that is not a number or out of range
                    raise _Deny(400, "malformed port in the request target") from None
                if (th, tp) != (hh, hp):
                    raise _Deny(421, "request target and Host header disagree")
                req.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            elif not target.startswith("/"):
                raise _Deny(400, "unsupported request target")
            elif mode == "proxy" and not tls:
                raise _Deny(400, "the proxy needs absolute-form requests or CONNECT")
            if pinned is not None and hh != pinned:
                raise _Deny(421, f"Host {hh[:255]} does not match the connection's host {pinned}"
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
            limit = sbx.policy.request_limit(rule)
            length = self._body_length(req, limit)
            self._check_upload(rule, length)
            self._inject(sbx, req, tls)
            plain_path = req.path.split("?", 1)[0]
            holds = [a for a in rule.approvals or () if a.matches(method, plain_path, length)]
            # With a declared length the first match is certain: a session approval of it needs no body.
            covered = not holds or (length is not None
                                    and self.approvals.granted(sbx.sandbox_id, _grant_key(rule, holds[0])))
            if not covered:
                # The body decides (min_body_bytes) and is shown: it is read whole (within the request
                # limit, charged to the buffer budget) and forwarded only once the request may go.
                body, reserved = await self._read_body(sbx, client, req, limit)
                length = len(body)
                match = next((a for a in holds if a.matches(method, plain_path, length)), None)
                if match is not None and not self.approvals.granted(sbx.sandbox_id, _grant_key(rule, match)):
                    await self._hold(sbx, client, req, rule, match, body, source)
            await self._inject_tokens(sbx, req, tls, source)
            upstream, resolved = await self._upstream_for(sbx, req, tls, upstream)
            status, resp_len = await self._exchange(sbx, client, upstream, req, length, limit, body)
        except _Deny as deny:
            if upstream is not None and deny.status != 429:
                upstream.close()  # it may have seen part of a request or response: never reuse it
                upstream = None
            self._audit(sbx, kind="http", decision="deny", source=source, destination=req.host or pinned,
                        resolved_ip=resolved, method=method, path=_scrub(sbx, req.path), status=deny.status,
                        rule=deny.rule, reason=deny.reason, bytes_out=req.bytes_out, detail=deny.detail)
            await self._deny(client, deny)
            return (not deny.close and client.conn.their_state is h11.DONE), pinned, upstream
        finally:
            if reserved and sbx.budget is not None:
                sbx.budget.release(reserved)
        self._audit(sbx, kind="http", decision="allow", source=source, destination=req.host,
                    resolved_ip=resolved, method=method, path=_scrub(sbx, req.path), status=status,
                    rule=req.rule.domain if req.rule else None, bytes_out=req.bytes_out, bytes_in=resp_len,
                    secret_ids=req.secret_ids,
                    detail={"approval_id": req.approval_id} if req.approval_id else None)
        return True, pinned, upstream

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

    @staticmethod
    def _check_upload(rule: DomainRule, size: int | None) -> None:
        """Refuse a body over the rule's ``forbid_uploads_above`` (declared or counted so far)."""
        cap = rule.forbid_uploads_above
        if cap is not None and size is not None and size > cap:
            what = "any request body" if cap == 0 else f"request bodies over {cap} bytes"
            raise _Deny(403, f"uploads to {rule.domain} are forbidden ({what})", rule=rule.domain)

    async def _read_body(self, sbx: SandboxEgress, client: _Client, req: _Request, limit: int
                         ) -> tuple[bytes, int]:
        """The whole request body (a request held for approval, or one whose size decides whether it is
        held), and the bytes reserved from the sandbox's budget for it, which the caller releases."""
        assert req.rule is not None and sbx.budget is not None
        pace = Pace(self.limits.min_rate, self.limits.rate_grace)
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]), left=pace.remaining)
        chunks: list[bytes] = []
        reserved = 0
        try:
            while True:
                try:
                    event = await client.next_event(pace.remaining)
                except TimeoutError:
                    raise _Deny(408, "request body below the minimum rate", rule=req.rule.domain) from None
                except h11.RemoteProtocolError:
                    raise _Deny(400, "malformed request body") from None
                if isinstance(event, h11.Data):
                    data = bytes(event.data)
                    req.bytes_out += len(data)
                    pace.add(len(data))
                    if req.bytes_out > limit:
                        raise _Deny(413, f"request body over {limit} bytes", rule=req.rule.domain)
                    self._check_upload(req.rule, req.bytes_out)
                    try:
                        await sbx.budget.reserve(len(data), self.limits.head_timeout)
                    except TimeoutError:
                        raise _Deny(503, "egress buffer budget exhausted", rule=req.rule.domain) from None
                    reserved += len(data)
                    chunks.append(data)
                elif isinstance(event, h11.EndOfMessage):
                    body = b"".join(chunks)
                    req.bytes_out = 0  # counted again as it is sent upstream
                    return body, reserved
                else:
                    raise _Deny(400, "request body ended early")
        except BaseException:
            sbx.budget.release(reserved)
            raise

    def _preview(self, sbx: SandboxEgress, body: bytes) -> str:
        """The start of a held body as an approver sees it: placeholders and secrets redacted."""
        patterns = self._patterns(sbx)
        head = body[:PREVIEW_BYTES + patterns.window]
        for ph in sbx.placeholders:
            head = head.replace(ph.encode(), b"[PLACEHOLDER]")
        try:
            head = patterns.redact(head)
            patterns.check_leak(head)
        except SecretLeak:
            return "[preview withheld: the body holds part of a secret]"
        return head[:PREVIEW_BYTES].decode("utf-8", "replace")

    async def _hold(self, sbx: SandboxEgress, client: _Client, req: _Request, rule: DomainRule,
                    match: ApprovalRule, body: bytes, source: str) -> None:
        """Hold the request until its approval is decided; returns when approved, else raises a 403."""
        assert match.name is not None
        for ph, binding in sbx.placeholders.items():
            if ph.encode() in body:
                raise _Deny(403, f"placeholder of {binding.secret} in the request body", rule=rule.domain)
        if self.approvals.pending_of(sbx.sandbox_id) >= PENDING_PER_SANDBOX:
            raise _Deny(429, f"more than {PENDING_PER_SANDBOX} requests of this sandbox await approval",
                        rule=rule.domain)
        now = time.time()
        approval = self.approvals.open(Approval(
            id=new_approval_id(), sandbox_id=sbx.sandbox_id, session_id=sbx.session_id,
            destination=req.host, method=req.method, path=_scrub(sbx, req.path), rule=rule.domain,
            approval_rule=match.name, scope=match.scope, preview=self._preview(sbx, body),
            body_bytes=len(body), created_at=now, expires_at=now + match.timeout_s))
        if sbx.policy.approval_webhook:
            self.notifier.notify(sbx.policy.approval_webhook, approval.as_dict())
        approval.waiter = asyncio.current_task()
        waiter = asyncio.ensure_future(self.approvals.wait(approval, _grant_key(rule, match)))
        watcher = asyncio.ensure_future(self._watch_client(client))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not waiter.done():
                waiter.cancel()  # the connection went away: the approval is cancelled as abandoned
            await asyncio.gather(watcher, waiter, return_exceptions=True)
        if waiter.cancelled() or waiter.exception() is not None:
            raise _Deny(403, f"approval {approval.id} abandoned: the client went away", rule=rule.domain)
        outcome = waiter.result()
        if outcome.approved:
            req.approval_id = approval.id
            return
        messages = {"denied": "approval denied", "timeout": f"approval timed out after {match.timeout_s} s",
                    "cancelled": "approval cancelled"}
        message = messages.get(outcome.state, "approval refused")
        if outcome.state == "denied" and outcome.decided_by:
            message += f" by {outcome.decided_by}"
        raise _Deny(403, f"{message} (approval {approval.id})"
                    + (f": {outcome.reason[:200]}" if outcome.reason else ""), rule=rule.domain,
                    body={"error": f"approval_{outcome.state}", "approval_id": approval.id,
                          "message": message, "reason": outcome.reason, "decided_by": outcome.decided_by},
                    detail={"approval_id": approval.id, "decision": outcome.state,
                            "decided_by": outcome.decided_by})

    @staticmethod
    async def _watch_client(client: _Client) -> None:
        """Returns when the held request's client closes its connection. Bytes it pipelines meanwhile are
        kept for h11 (bounded: a client that sends more while waiting is treated as gone)."""
        extra = 0
        while True:
            data = await client.reader.read(_STREAM_LIMIT)
            if not data:
                return
            extra += len(data)
            if extra > _STREAM_LIMIT:
                return
            client.conn.receive_data(data)

    @staticmethod
    def _body_length(req: _Request, limit: int) -> int | None:
        """The request body's declared length (None: chunked), refused up front when over ``limit``."""
        assert req.rule is not None
        if _header(req.headers, b"transfer-encoding"):
            return None  # h11 accepts only chunked; the size is checked as it streams
        lengths = _header(req.headers, b"content-length")
        length = int(lengths[0]) if lengths else 0  # h11 has checked the value
        if length > limit:
            raise _Deny(413, f"request body over {limit} bytes", rule=req.rule.domain)
        return length

    def _inject(self, sbx: SandboxEgress, req: _Request, tls: bool) -> None:
        """Swap placeholders for secrets in the request head where a binding allows it; refuse any other
        use of one. (The body is checked for placeholders as it streams, see _send_body.)"""
        if not sbx.placeholders:
            return
        for ph, binding in sbx.placeholders.items():
            needle = ph.encode()
            if needle in req.target.encode("latin-1") or needle in unquote(req.target).encode("latin-1"):
                raise _Deny(403, f"placeholder of {binding.secret} in the URL")
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
            req.headers = new_headers

    async def _inject_tokens(self, sbx: SandboxEgress, req: _Request, tls: bool, source: str) -> None:
        """Connections' tokens into the head (token_injection.py); a refusal becomes a _Deny."""
        if not sbx.policy.connections:
            return
        rule = req.rule.domain if req.rule else None
        head = TokenRequest(req.host, req.method, _scrub(sbx, req.path), req.headers, tls, source, rule)
        try:
            req.connection_ids += await inject_tokens(self.tokens, sbx.policy, sbx.session_id, head,
                                                      lambda **fields: self._audit(sbx, **fields))
        except TokenRefused as refused:
            raise _Deny(refused.status, refused.reason, rule=rule) from None
        req.headers = head.headers

    async def _resolve(self, sbx: SandboxEgress, host: str) -> str:
        """The address the connection is pinned to (screen_host), never the upstream proxy's; one in the
        operator's internal networks only where the sandbox's tenant is granted it (internal_networks.py)."""
        proxy = self.upstream_proxy
        if proxy is not None and host == proxy.host:
            raise _Deny(403, "the upstream proxy is not a destination")
        try:
            ip = await screen_host(host, self.resolver, [*self.allow_networks, *self.internal.networks])
            if self._proxy_addresses is not None:
                self.internal.proxy.update(ipaddress.ip_address(a) for a in await self._proxy_addresses.get())
        except ResolveError as exc:
            raise _Deny(502, exc.message) from None
        except DestinationRefused as exc:
            raise _Deny(403, exc.message) from None
        except ProxyRefused as exc:
            raise _Deny(502, str(exc)) from None
        if self.internal.is_proxy(ip):
            raise _Deny(403, f"{host} resolves to the upstream proxy's address")
        if is_public_address(ip, self.allow_networks):
            return ip
        verdict = self.internal.verdict(ip, sbx.granted)
        if verdict == "not_granted":
            raise _Deny(403, f"{host} resolves to {ip}, in an internal network this session's tenant is not "
                             "granted (an admin grants it: POST /v1/egress-grants)",
                        detail={"internal_network": "not_granted"})
        if verdict != "allowed":
            raise _Deny(403, f"{host} resolves to {ip}, a node, control-plane, loopback or link-local "
                             "address the internal networks do not name explicitly")
        return ip

    async def _upstream_for(self, sbx: SandboxEgress, req: _Request, tls: bool, current: _Upstream | None
                            ) -> tuple[_Upstream, str]:
        if current is not None and current.key[0] == req.host and current.conn.our_state is h11.IDLE:
            return current, current.key[1]
        if current is not None:
            current.close()
        ip = await self._resolve(sbx, req.host)
        port = self.upstream_https_port if tls else self.upstream_http_port
        try:
            reader, writer = await asyncio.wait_for(self._open(req.host, ip, port, tls), self.connect_timeout)
        except ssl.SSLCertVerificationError as exc:
            raise _Deny(502, f"upstream certificate of {req.host} failed verification: "
                             f"{exc.verify_message}") from None
        except ProxyRefused as exc:
            raise _Deny(502, f"cannot reach {req.host}: {exc}") from None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise _Deny(502, f"cannot reach {req.host}: {exc.__class__.__name__}") from None
        return _Upstream(reader, writer, (req.host, ip, port)), ip

    async def _open(self, host: str, ip: str, port: int, tls: bool
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the pinned ``ip``: direct, or through the upstream proxy's tunnel (with TLS to
        ``host`` inside it)."""
        if self.upstream_proxy is None or self._proxy_addresses is None:
            return await asyncio.open_connection(ip, port, ssl=self.upstream_ssl if tls else None,
                                                 server_hostname=host if tls else None, limit=_STREAM_LIMIT)
        reader, writer = await open_tunnel(self.upstream_proxy, self._proxy_addresses, ip, port,
                                           limit=_STREAM_LIMIT)
        if tls:
            try:
                await writer.start_tls(self.upstream_ssl, server_hostname=host)
            except BaseException:
                writer.close()
                raise
        return reader, writer

    def _is_bound(self, sbx: SandboxEgress, host: str) -> bool:
        """Only a destination a secret is bound to can ever have received one: its responses are
        redacted (and must come unencoded); every other response streams through untouched."""
        return (any(b.domain == host for b in sbx.placeholders.values())
                or bool(sbx.policy.connections_for(host)))

    def _patterns(self, sbx: SandboxEgress) -> SecretPatterns:
        generation = self.tokens.generation() if sbx.policy.connections else -1
        if sbx.patterns is not None and sbx.patterns_tokens != generation:
            self._forget_patterns(sbx)  # a token it binds changed: the old one's forms must go too
        if sbx.patterns is None:
            values: list[bytes] = []
            for binding in sbx.placeholders.values():
                with contextlib.suppress(CapsaError):
                    values.append(self.secrets.reveal(binding.secret).encode())
            for conn in sbx.policy.connections:
                token = self.tokens.peek(conn.connection)
                if token:
                    values.append(token.encode())
            sbx.patterns = SecretPatterns(values)
            sbx.patterns_tokens = generation
        return sbx.patterns

    async def _exchange(self, sbx: SandboxEgress, client: _Client, up: _Upstream, req: _Request,
                        length: int | None, limit: int, body: bytes | None = None) -> tuple[int, int]:
        """Send the request (streaming its body, or ``body`` when it was read already) and stream the
        response back; (status, body bytes)."""
        assert req.rule is not None and sbx.budget is not None
        patterns = self._patterns(sbx) if self._is_bound(sbx, req.host) else None
        # The most this exchange buffers at once: a read chunk in each direction plus the redaction window.
        hold = 2 * self.limits.read_chunk + (patterns.window if patterns else 0)
        try:
            await sbx.budget.reserve(hold, self.limits.head_timeout)
        except TimeoutError:
            raise _Deny(503, "egress buffer budget exhausted", rule=req.rule.domain) from None
        try:
            await self._send_request(sbx, client, up, req, length, limit, patterns is not None, body)
            return await self._stream_response(sbx, client, up, req, patterns)
        except (OSError, TimeoutError, h11.RemoteProtocolError, ssl.SSLError) as exc:
            raise _Deny(502, f"upstream error: {exc.__class__.__name__}", rule=req.rule.domain) from None
        finally:
            sbx.budget.release(hold)

    async def _send_request(self, sbx: SandboxEgress, client: _Client, up: _Upstream, req: _Request,
                            length: int | None, limit: int, bound: bool, body: bytes | None = None) -> None:
        assert req.rule is not None
        headers = [(k, v) for k, v in req.headers if k not in _HOP_BY_HOP and k != b"expect"]
        if bound:
            # Redaction reads the response body: every response from a bound destination comes unencoded.
            headers = [(k, v) for k, v in headers if k != b"accept-encoding"]
            headers.append((b"accept-encoding", b"identity"))
        if length is None:
            headers.append((b"transfer-encoding", b"chunked"))
        elif length or req.method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", str(length).encode()))
        pace = Pace(self.limits.min_rate, self.limits.rate_grace)
        try:
            head = h11.Request(method=req.method, target=req.path, headers=headers)
        except h11.LocalProtocolError:
            # Its message quotes the offending header value, which may hold a secret: never pass it on.
            raise _Deny(400, "request cannot be framed for the upstream") from None
        await up.send(head, pace.remaining)
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]), left=pace.remaining)
        needles = [(ph.encode(), b.secret) for ph, b in sbx.placeholders.items()]
        carry_len = max((len(n) for n, _ in needles), default=1) - 1
        carry = b""
        read: list[h11.Event] | None = None
        if body is not None:
            read = [h11.Data(data=body), h11.EndOfMessage()] if body else [h11.EndOfMessage()]
        while True:
            try:
                event = read.pop(0) if read is not None else await client.next_event(pace.remaining)
            except TimeoutError:
                raise _Deny(408, "request body below the minimum rate", rule=req.rule.domain) from None
            except h11.RemoteProtocolError:
                raise _Deny(400, "malformed request body") from None
            if isinstance(event, h11.Data):
                data = bytes(event.data)
                req.bytes_out += len(data)
                pace.add(len(data))
                if req.bytes_out > limit:
                    raise _Deny(413, f"request body over {limit} bytes", rule=req.rule.domain)
                self._check_upload(req.rule, req.bytes_out)
                window = carry + data
                for needle, secret_id in needles:
                    if needle in window:
                        raise _Deny(403, f"placeholder of {secret_id} in the request body")
                carry = window[-carry_len:] if carry_len else b""
                await up.send(h11.Data(data=data), pace.remaining)
            elif isinstance(event, h11.EndOfMessage):
                await up.send(h11.EndOfMessage(), pace.remaining)
                return
            else:
                raise _Deny(400, "request body ended early")

    async def _stream_response(self, sbx: SandboxEgress, client: _Client, up: _Upstream, req: _Request,
                               patterns: SecretPatterns | None) -> tuple[int, int]:
        assert req.rule is not None
        rule = req.rule.domain
        response = await up.next_event(_until(time.monotonic() + self.limits.upstream_timeout))
        while isinstance(response, h11.InformationalResponse):
            response = await up.next_event(_until(time.monotonic() + self.limits.upstream_timeout))
        if not isinstance(response, h11.Response):
            raise _Deny(502, "upstream closed without a response", rule=rule)
        limit = sbx.policy.response_limit(req.rule)
        no_body = req.method == "HEAD" or response.status_code in (204, 304)
        if not no_body and req.rule.download_content_types is not None:
            types = _header(response.headers, b"content-type")
            value = types[0].decode("latin-1") if len(types) == 1 else None
            if not req.rule.allows_download(value):
                shown = _printable(types[0]) if len(types) == 1 else ("none" if not types else "several")
                raise _Deny(403, f"download of content type {shown} is not allowed for {rule}", rule=rule)
        lengths = _header(response.headers, b"content-length")
        if len(lengths) == 1 and int(lengths[0]) > limit and not no_body:
            raise _Deny(502, f"response body over {limit} bytes", rule=rule)
        headers = [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]
        redactor: StreamRedactor | None = None
        if patterns:
            encoded = any(k == b"content-encoding" and v.strip().lower() != b"identity" for k, v in headers)
            if encoded and not no_body:
                raise _Deny(502, "encoded response from a destination a secret is bound to cannot be checked",
                            rule=rule)
            try:
                headers = [(k, patterns.redact(v)) for k, v in headers]
                for _k, v in headers:
                    patterns.check_leak(v)
            except SecretLeak:
                raise _Deny(502, "response header holds part of a secret", rule=rule) from None
            redactor = StreamRedactor(patterns)
            if no_body and len(lengths) == 1:
                headers.append((b"content-length", lengths[0]))
            elif len(lengths) == 1 and int(lengths[0]) <= _SMALL_BODY:
                return await self._small_redacted(sbx, client, up, req, response, headers, patterns,
                                                  int(lengths[0]))
            # Otherwise no length: redaction may change it, h11 frames the body as chunked.
        elif len(lengths) == 1:
            headers.append((b"content-length", lengths[0]))
        pace = Pace(self.limits.min_rate, self.limits.rate_grace)
        await client.send(h11.Response(status_code=response.status_code, headers=headers,
                                       reason=response.reason), left=pace.remaining)
        size = 0
        pending: h11.Event | None = None
        while True:
            ev = pending if pending is not None else await up.next_event(pace.remaining)
            pending = None
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                pace.add(len(ev.data))
                if size > limit:
                    raise _Deny(502, f"response body over {limit} bytes (cut off)", rule=rule)
                nxt = up.conn.next_event()
                if nxt is not h11.NEED_DATA:
                    pending = nxt  # type: ignore[assignment]
                try:
                    out = redactor.feed(bytes(ev.data)) if redactor else bytes(ev.data)
                    if redactor and isinstance(pending, h11.EndOfMessage):
                        out += redactor.finish()  # all of it in one piece: nothing held back between chunks
                        redactor = None
                except SecretLeak:
                    raise _Deny(502, "response holds part of a secret (cut off)", rule=rule) from None
                if out:
                    await client.send(h11.Data(data=out), left=pace.remaining)
            elif isinstance(ev, h11.EndOfMessage):
                if redactor is not None:
                    try:
                        out = redactor.finish()
                    except SecretLeak:
                        raise _Deny(502, "response holds part of a secret (cut off)", rule=rule) from None
                    if out:
                        await client.send(h11.Data(data=out), left=pace.remaining)
                break
            else:
                raise _Deny(502, "upstream response ended early", rule=rule)
        await client.send(h11.EndOfMessage(), left=pace.remaining)
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
        else:
            up.close()
        return response.status_code, size

    async def _small_redacted(self, sbx: SandboxEgress, client: _Client, up: _Upstream, req: _Request,
                              response: h11.Response, headers: list[tuple[bytes, bytes]],
                              patterns: SecretPatterns, length: int) -> tuple[int, int]:
        """A small bound-host body (declared length up to _SMALL_BODY), read whole (its bytes charged to the
        budget), redacted, and sent with its new exact length, as clients of most APIs expect."""
        assert req.rule is not None and sbx.budget is not None
        rule = req.rule.domain
        try:
            await sbx.budget.reserve(length, self.limits.head_timeout)
        except TimeoutError:
            raise _Deny(503, "egress buffer budget exhausted", rule=rule) from None
        try:
            pace = Pace(self.limits.min_rate, self.limits.rate_grace)
            body = bytearray()
            while True:
                ev = await up.next_event(pace.remaining)
                if isinstance(ev, h11.Data):
                    body += ev.data
                    pace.add(len(ev.data))
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    raise _Deny(502, "upstream response ended early", rule=rule)
            out = patterns.redact(bytes(body))
            try:
                patterns.check_leak(out)
            except SecretLeak:
                raise _Deny(502, "response holds part of a secret", rule=rule) from None
            events: list[h11.Event] = [h11.Response(
                status_code=response.status_code, reason=response.reason,
                headers=[*headers, (b"content-length", str(len(out)).encode())])]
            if out:
                events.append(h11.Data(data=out))
            await client.send(*events, h11.EndOfMessage(), left=pace.remaining)
        finally:
            sbx.budget.release(length)
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
        else:
            up.close()
        return response.status_code, len(body)

    async def _deny(self, client: _Client, deny: _Deny) -> None:
        if deny.body is not None:
            body = json.dumps(deny.body).encode() + b"\n"
            kind = b"application/json"
        else:
            body = f"capsa egress: {deny.reason}\n".encode()
            kind = b"text/plain"
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
                   (b"x-capsa-egress", b"denied")]
        if deny.close or client.conn.their_state is not h11.DONE:
            headers.append((b"connection", b"close"))
        try:
            if client.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await client.send(h11.Response(status_code=deny.status, headers=headers),
                                  h11.Data(data=body), h11.EndOfMessage(),
                                  left=_until(time.monotonic() + self.limits.head_timeout))
        except (h11.LocalProtocolError, ConnectionError, TimeoutError):
            pass

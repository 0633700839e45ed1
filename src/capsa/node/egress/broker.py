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

The parts, each in its own module: listeners.py (sockets, connection caps), tls.py (SNI, ClientHello, the
handshakes), request_loop.py (the h11 loop, CONNECT, one body loop), request_head.py, injection.py,
approval_hold.py, upstream.py, response.py and dns.py (the stub); this module wires them and keeps the
register of sandboxes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import Mapping, Sequence

from capsa.common.destinations import Resolver, SystemResolver
from capsa.common.egress_networks import UpstreamProxy
from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.node.egress.approval_hold import ApprovalHolds, approval_event
from capsa.node.egress.approvals import ApprovalBook
from capsa.node.egress.audit import AuditSink, emit_safely
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.injection import Credentials
from capsa.node.egress.internal_networks import InternalNetworks
from capsa.node.egress.limits import BrokerLimits, ByteBudget
from capsa.node.egress.listeners import Listeners
from capsa.node.egress.request_loop import RequestLoop
from capsa.node.egress.sandboxes import PolicyUpdate, SandboxEgress, assign_placeholders, parse_networks
from capsa.node.egress.secrets import SecretStore
from capsa.node.egress.tls import TlsFront
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.egress.upstream import Upstreams
from capsa.node.egress.webhooks import Notifier, WebhookNotifier
from capsa.node.net.sandbox_net import ServicePorts

__all__ = ["EgressBroker"]


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
        self.sink = sink
        self.tokens = tokens if tokens is not None else ConnectionTokens()
        """Access tokens of the connections policies bind (fetched from the control plane)."""
        resolver = resolver or SystemResolver()
        self.limits = limits or BrokerLimits()
        self.budget = ByteBudget(self.limits.buffer_bytes_total)
        self._sandboxes: dict[str, SandboxEgress] = {}
        self.approvals = approvals or ApprovalBook()
        self.approvals.on_change = lambda approval: emit_safely(self.sink, approval_event(approval))
        self.notifier: Notifier = notifier if notifier is not None else WebhookNotifier(resolver)
        self.upstreams = Upstreams(
            resolver=resolver, upstream_ssl=upstream_ssl or ssl.create_default_context(),
            allow_networks=[ipaddress.ip_network(n) for n in allow_networks],
            internal=internal or InternalNetworks(), proxy=upstream_proxy, http_port=upstream_http_port,
            https_port=upstream_https_port, connect_timeout=connect_timeout)
        credentials = Credentials(secrets, self.tokens)
        self._tls = TlsFront(self.limits.head_timeout)
        requests = RequestLoop(self.limits, self.upstreams, credentials,
                               ApprovalHolds(self.approvals, self.notifier, credentials), self._tls)
        self._listeners = Listeners(self.limits, requests, self._tls)

    @property
    def active(self) -> int:
        """Connections the node serves now, all sandboxes together."""
        return self._listeners.active

    @property
    def connection_cap(self) -> int:
        """Connections the node serves at once, all sandboxes together (bounded by RLIMIT_NOFILE)."""
        return self._listeners.connection_cap

    # -- sandbox lifecycle -------------------------------------------------------------------------

    def register(self, sandbox_id: str, guest_ip: str, policy: EgressPolicy, *,
                 session_id: str | None = None,
                 placeholders: Mapping[str, str] | None = None,
                 networks: Sequence[str] = ()) -> SandboxEgress:
        """``placeholders`` (secret id -> placeholder) are the session's own, recorded by the control plane
        (a restored or branched sandbox gets the ones its guest already holds); a binding without one gets
        a new random placeholder. ``networks``: the networks its tenant was granted (CIDRs)."""
        if sandbox_id in self._sandboxes:
            raise CapsaError(f"sandbox {sandbox_id} is already registered", code="conflict", status=409)
        ipaddress.ip_address(guest_ip)
        sbx = SandboxEgress(sandbox_id, session_id, guest_ip, policy,
                            SandboxCA(sandbox_id, [r.domain for r in policy.domains]), self.sink)
        sbx.budget = ByteBudget(self.limits.buffer_bytes_per_sandbox, parent=self.budget)
        sbx.placeholders = assign_placeholders(policy, {}, placeholders or {})
        sbx.granted = parse_networks(networks)
        self._sandboxes[sandbox_id] = sbx
        self._tls.add(sbx)
        return sbx

    def bound_connections(self) -> set[str]:
        """The connections some registered sandbox's policy binds."""
        return {c.connection for sbx in self._sandboxes.values() for c in sbx.policy.connections}

    def get(self, sandbox_id: str) -> SandboxEgress:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise CapsaError(f"unknown sandbox {sandbox_id}", code="not_found", status=404) from None

    def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                      placeholders: Mapping[str, str] | None = None,
                      networks: Sequence[str] | None = None) -> PolicyUpdate:
        """Replace a running sandbox's policy. Placeholders of bindings that remain keep their value;
        new bindings get the given placeholder or a new one (see ``placeholder_env``); removed ones stop
        working. ``networks`` (None: unchanged) replaces its tenant's granted networks."""
        sbx = self.get(sandbox_id)
        kept = assign_placeholders(policy, sbx.placeholders, placeholders or {})
        granted = sbx.granted if networks is None else parse_networks(networks)
        reissue = any(not sbx.ca.covers(r.domain[2:] if r.is_wildcard else r.domain) for r in policy.domains)
        sbx.policy = policy
        sbx.placeholders = kept
        sbx.granted = granted
        sbx.patterns.forget()
        sbx.buckets.clear()
        self.approvals.clear_grants(sandbox_id)  # session approvals were given under the old rules
        if reissue:
            # The TLS paths read sbx.ca on every handshake, so listeners pick the new CA up at once.
            sbx.ca = SandboxCA(sandbox_id, [r.domain for r in policy.domains])
        return PolicyUpdate(ca_reissued=reissue, ca_pem=sbx.ca.cert_pem)

    async def listen(self, sandbox_id: str, host: str, *, netns: str | None = None,
                     ports: ServicePorts | None = None) -> None:
        """Open the sandbox's listeners on ``host`` inside ``netns`` (``None``: this namespace)."""
        await self._listeners.open(self.get(sandbox_id), host, netns, ports or ServicePorts())

    async def unregister(self, sandbox_id: str) -> None:
        """Close the sandbox's listeners and connections and forget its CA and placeholders."""
        sbx = self._sandboxes.pop(sandbox_id, None)
        self._tls.drop(sandbox_id)
        # Held requests are denied (their connections get the 403 if they are still there to read it).
        closed = self.approvals.cancel_sandbox(sandbox_id, "the sandbox stopped")
        waiters = [a.waiter for a in closed if a.waiter is not None]
        if waiters:
            await asyncio.wait(waiters, timeout=1.0)
        if sbx is None:
            return
        await self._listeners.close(sbx)
        sbx.placeholders.clear()
        sbx.patterns.forget()

    async def close(self) -> None:
        for sid in list(self._sandboxes):
            await self.unregister(sid)
        await self.notifier.close()

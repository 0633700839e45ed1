"""What the broker knows about one sandbox (:class:`SandboxEgress`), and the placeholders and networks it is
registered with."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from capsa.common.egress_networks import IPNetwork
from capsa.common.egress_policy import EgressPolicy, SecretBinding
from capsa.common.errors import CapsaError
from capsa.node.egress.audit import AuditSink, EgressEvent, emit_safely
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.limits import DNS_QUERIES_PER_SECOND, ByteBudget, TokenBucket
from capsa.node.egress.redaction import PatternCache
from capsa.node.egress.secrets import is_placeholder, new_placeholder

__all__ = ["PolicyUpdate", "SandboxEgress", "assign_placeholders", "parse_networks"]


@dataclass(frozen=True)
class PolicyUpdate:
    ca_reissued: bool
    """True when the new policy allows names the old CA's constraints did not cover: the guest must
    trust ``ca_pem`` (the new CA) for those names."""
    ca_pem: bytes


@dataclass
class SandboxEgress:
    """Everything the broker knows about one sandbox."""

    sandbox_id: str
    session_id: str | None
    guest_ip: str
    policy: EgressPolicy
    ca: SandboxCA
    sink: AuditSink
    """Where this sandbox's egress events go (see :meth:`audit`)."""
    placeholders: dict[str, SecretBinding] = field(default_factory=dict)
    """placeholder → binding; the placeholders are what the sandbox's environment holds."""
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    dns_transport: asyncio.DatagramTransport | None = None
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    dns_bucket: TokenBucket = field(default_factory=lambda: TokenBucket(DNS_QUERIES_PER_SECOND * 60,
                                                                         DNS_QUERIES_PER_SECOND * 2))
    dns_refused: int = 0
    """Queries refused by the rate limit since the last audited one."""
    bound: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Where the listeners are: ``http``, ``tls``, ``proxy``, ``dns`` → (address, port)."""
    budget: ByteBudget | None = None
    """The bytes this sandbox's transfers may buffer at once (charged to the node's budget too)."""
    accept_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    listen_socks: list[socket.socket] = field(default_factory=list)
    patterns: PatternCache = field(default_factory=PatternCache)
    """Redaction forms of the secrets this sandbox binds; built on first use, dropped on policy change."""
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

    def audit(self, **fields: object) -> None:
        """Write one egress event of this sandbox (never raises)."""
        emit_safely(self.sink, EgressEvent(session_id=self.session_id, sandbox_id=self.sandbox_id,
                                           **fields))  # type: ignore[arg-type]

    def scrub(self, path: str) -> str:
        """The path as audited: bounded, and without placeholders (audit readers need not learn them)."""
        for ph in self.placeholders:
            path = path.replace(ph, "[PLACEHOLDER]")
        return path[:512]

    def is_bound(self, host: str) -> bool:
        """Only a destination a secret is bound to can ever have received one: its responses are
        redacted (and must come unencoded); every other response streams through untouched."""
        return (any(b.domain == host for b in self.placeholders.values())
                or bool(self.policy.connections_for(host)))


def assign_placeholders(policy: EgressPolicy, current: Mapping[str, SecretBinding],
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
                raise CapsaError(f"not a placeholder for {binding.secret}", code="bad_request", status=422)
            old = wanted
        out[old or new_placeholder()] = binding
    return out


def parse_networks(cidrs: Sequence[str]) -> tuple[IPNetwork, ...]:
    """The networks a sandbox's tenant was granted, from their CIDRs."""
    try:
        return tuple(ipaddress.ip_network(c) for c in cidrs)
    except ValueError as exc:
        raise CapsaError(f"granted networks: {exc}", code="bad_request", status=422) from None

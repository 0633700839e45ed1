"""The DNS stub a sandbox queries.

The stub never recurses: a name the sandbox's policy allows resolves to the broker's address in the
sandbox's namespace (the broker then resolves the real destination itself); every other name gets
NXDOMAIN. Every query is audited, which is also how DNS exfiltration attempts become visible.

The broker resolves destinations on its own behalf with :mod:`capsa.common.destinations` (the control plane
screens its own destinations with it too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from capsa.common.addresses import is_ip_literal
from capsa.node.egress import dnswire
from capsa.node.egress.limits import DNS_QUERIES_PER_SECOND
from capsa.node.egress.sandboxes import SandboxEgress

__all__ = ["DnsAnswer", "DnsHandler", "DnsServerProtocol", "stub_answer"]

# (rcode, IPv4 addresses) for a (name, qtype, source ip) question.
DnsAnswer = tuple[int, list[str]]
DnsHandler = Callable[[dnswire.Question, str], DnsAnswer]


class DnsServerProtocol(asyncio.DatagramProtocol):
    """A UDP DNS responder that hands each well-formed single question to ``handler``."""

    def __init__(self, handler: DnsHandler) -> None:
        self._handler = handler
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self._transport is None:
            return
        try:
            q = dnswire.parse_query(data)
        except dnswire.DnsFormatError:
            reply = dnswire.build_error(data, 1)
            if reply is not None:
                self._transport.sendto(reply, addr)
            return
        rcode, addresses = self._handler(q, str(addr[0]))
        self._transport.sendto(dnswire.build_response(q, rcode, addresses), addr)


def stub_answer(sbx: SandboxEgress, broker_ip: str, q: dnswire.Question, source: str) -> DnsAnswer:
    """The stub's answer to a query of the sandbox (audited): ``broker_ip`` for a name its policy allows."""
    base = {"kind": "dns", "source": source, "destination": q.name, "method": f"QTYPE{q.qtype}"}
    if source != sbx.guest_ip:
        sbx.audit(decision="deny", reason="query from an address that is not the sandbox's",
                  status=dnswire.REFUSED, **base)
        return dnswire.REFUSED, []
    if not sbx.dns_bucket.take():
        # A flood is audited in summary (one event per ~second of refusals), not query by query.
        sbx.dns_refused += 1
        if sbx.dns_refused % DNS_QUERIES_PER_SECOND == 1:
            sbx.audit(decision="deny", reason="DNS query rate limit exceeded",
                      status=dnswire.REFUSED, count=sbx.dns_refused, **base)
        return dnswire.REFUSED, []
    rule = None if is_ip_literal(q.name) else sbx.policy.rule_for(q.name)
    if rule is None or q.qclass != 1:
        sbx.audit(decision="deny", reason="name not allowed by policy", status=dnswire.NXDOMAIN, **base)
        return dnswire.NXDOMAIN, []
    sbx.audit(decision="allow", rule=rule.domain, status=dnswire.NOERROR, **base)
    # The sandbox only ever talks to the broker; AAAA gets an empty answer (the sandbox has no IPv6).
    return dnswire.NOERROR, [broker_ip] if q.qtype == dnswire.QTYPE_A else []

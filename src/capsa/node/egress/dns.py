"""The DNS stub a sandbox queries, and the resolvers the broker uses on its own behalf.

The stub never recurses: a name the sandbox's policy allows resolves to the broker's address in the
sandbox's namespace (the broker then resolves the real destination itself); every other name gets
NXDOMAIN. Every query is audited, which is also how DNS exfiltration attempts become visible.

The :class:`Resolver` protocol and the system and static resolvers live in :mod:`capsa.common.destinations`
(the control plane screens its own destinations with them too); they are re-exported here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from capsa.common.addresses import is_ip_literal
from capsa.common.destinations import ResolveError, Resolver, StaticResolver, SystemResolver
from capsa.node.egress import dnswire
from capsa.node.egress.limits import DNS_QUERIES_PER_SECOND
from capsa.node.egress.sandboxes import SandboxEgress

__all__ = [
    "DnsAnswer",
    "DnsResolver",
    "DnsServerProtocol",
    "ResolveError",
    "Resolver",
    "StaticResolver",
    "SystemResolver",
    "static_dns_handler",
    "stub_answer",
]

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


def static_dns_handler(records: Mapping[str, Sequence[str]]) -> DnsHandler:
    """A handler answering A queries from a fixed table (test servers that play the outside world)."""
    table = {k.lower().rstrip("."): list(v) for k, v in records.items()}

    def handle(q: dnswire.Question, _source: str) -> DnsAnswer:
        if q.name not in table:
            return dnswire.NXDOMAIN, []
        return dnswire.NOERROR, table[q.name] if q.qtype == dnswire.QTYPE_A else []

    return handle


class _OneShot(asyncio.DatagramProtocol):
    def __init__(self, future: asyncio.Future[bytes]) -> None:
        self.future = future

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if not self.future.done():
            self.future.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class DnsResolver:
    """Asks one DNS server over UDP for A records (e.g. a test server inside a test namespace)."""

    def __init__(self, server: str, port: int = 53, timeout: float = 2.0, attempts: int = 2) -> None:
        ipaddress.ip_address(server)
        self.server, self.port, self.timeout, self.attempts = server, port, timeout, attempts

    async def _ask(self, host: str) -> tuple[int, list[str]]:
        loop = asyncio.get_running_loop()
        qid = random.SystemRandom().randrange(65536)
        fut: asyncio.Future[bytes] = loop.create_future()
        transport, _ = await loop.create_datagram_endpoint(lambda: _OneShot(fut),
                                                           remote_addr=(self.server, self.port))
        try:
            transport.sendto(dnswire.build_query(qid, host))
            data = await asyncio.wait_for(fut, self.timeout)
            return dnswire.parse_a_answers(data, qid, host)
        finally:
            transport.close()

    async def resolve(self, host: str) -> list[str]:
        last = "no answer"
        for _ in range(self.attempts):
            try:
                rcode, addresses = await self._ask(host)
            except (TimeoutError, OSError, dnswire.DnsFormatError) as exc:
                last = str(exc) or type(exc).__name__
                continue
            if rcode == dnswire.NXDOMAIN:
                raise ResolveError(f"{host} does not exist")
            if rcode != dnswire.NOERROR or not addresses:
                raise ResolveError(f"{host} has no address (rcode {rcode})")
            return addresses
        raise ResolveError(f"cannot resolve {host}: {last}")

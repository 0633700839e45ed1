"""Resolvers and a DNS answer table for tests that play the outside world: a fixed table
(:class:`StaticResolver`), a DNS server asked over UDP (:class:`DnsResolver`, e.g. a test server inside a
test namespace), and :func:`static_dns_handler` for such a server (:class:`DnsServerProtocol`).

capsa itself resolves with :class:`capsa.common.destinations.SystemResolver`; these satisfy the same
:class:`~capsa.common.destinations.Resolver` protocol."""

from __future__ import annotations

import asyncio
import ipaddress
import random
from collections.abc import Mapping, Sequence

from capsa.common.destinations import ResolveError
from capsa.node.egress import dnswire
from capsa.node.egress.dns import DnsAnswer, DnsHandler

__all__ = ["DnsResolver", "StaticResolver", "static_dns_handler"]


class StaticResolver:
    """Answers from a fixed table (names a test plays the outside world with)."""

    def __init__(self, records: Mapping[str, Sequence[str]]) -> None:
        self.records = {k.lower(): list(v) for k, v in records.items()}

    async def resolve(self, host: str) -> list[str]:
        found = self.records.get(host.lower())
        if not found:
            raise ResolveError(f"cannot resolve {host}")
        return list(found)


def static_dns_handler(records: Mapping[str, Sequence[str]]) -> DnsHandler:
    """A DNS server's handler answering A queries from a fixed table (test servers that play the outside
    world)."""
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

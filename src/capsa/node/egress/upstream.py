"""The broker's side towards destinations: where a request may go (the address it resolves to, pinned for
the connection) and the upstream connection it goes over, kept for the next request of the same client
connection to the same host.

A destination resolves (screen_host) to a public address, or to one of the operator's internal networks
(``CAPSA_EGRESS_ALLOW_NETWORKS``) that the sandbox's tenant was granted (internal_networks.py); never to the
upstream proxy's. With an upstream proxy every connection is a CONNECT tunnel through it, opened after every
check (upstream_proxy.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import Callable

import h11

from capsa.common.addresses import is_public_address
from capsa.common.destinations import DestinationRefused, ResolveError, Resolver, screen_host
from capsa.common.egress_networks import IPNetwork, UpstreamProxy
from capsa.node.egress.http1 import STREAM_LIMIT, Deny, next_event
from capsa.node.egress.internal_networks import InternalNetworks
from capsa.node.egress.upstream_proxy import ProxyAddresses, ProxyRefused, open_tunnel

__all__ = ["Upstream", "Upstreams"]


class Upstream:
    """One connection to a destination, spoken with h11; ``key`` is (host, pinned address, port)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[str, str, int]
                 ) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)

    async def next_event(self, left: Callable[[], float]) -> h11.Event:
        return await next_event(self.conn, self.reader, left)  # type: ignore[return-value]

    async def send(self, event: h11.Event, left: Callable[[], float]) -> None:
        try:
            data = self.conn.send(event) or b""
        except h11.LocalProtocolError:
            # Its message quotes the offending header value, which may hold a secret: never pass it on.
            raise Deny(400, "request cannot be framed for the upstream") from None
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), left())

    def finish(self) -> None:
        """After a response: ready for the next request when both sides are done, else closed."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        else:
            self.close()

    def close(self) -> None:
        self.writer.close()


class Upstreams:
    """Resolves, screens and connects to destinations."""

    def __init__(self, *, resolver: Resolver, upstream_ssl: ssl.SSLContext, allow_networks: list[IPNetwork],
                 internal: InternalNetworks, proxy: UpstreamProxy | None, http_port: int, https_port: int,
                 connect_timeout: float) -> None:
        """``allow_networks`` lets every sandbox's destinations resolve into otherwise refused ranges (a seam
        for tests); ``internal`` holds the operator's internal networks."""
        self.resolver = resolver
        self.upstream_ssl = upstream_ssl
        self.allow_networks = allow_networks
        self.internal = internal
        self.proxy = proxy
        self._proxy_addresses = ProxyAddresses(proxy) if proxy is not None else None
        self.http_port, self.https_port = http_port, https_port
        self.connect_timeout = connect_timeout

    async def for_request(self, host: str, granted: tuple[IPNetwork, ...], tls: bool, current: Upstream | None
                          ) -> tuple[Upstream, str]:
        """The connection to send a request for ``host`` on (``current`` when it serves that host and is idle,
        else a new one; ``current`` is closed then), and the address it is pinned to."""
        if current is not None and current.key[0] == host and current.conn.our_state is h11.IDLE:
            return current, current.key[1]
        if current is not None:
            current.close()
        ip = await self.resolve(host, granted)
        port = self.https_port if tls else self.http_port
        try:
            reader, writer = await asyncio.wait_for(self._open(host, ip, port, tls), self.connect_timeout)
        except ssl.SSLCertVerificationError as exc:
            raise Deny(502, f"upstream certificate of {host} failed verification: "
                            f"{exc.verify_message}") from None
        except ProxyRefused as exc:
            raise Deny(502, f"cannot reach {host}: {exc}") from None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise Deny(502, f"cannot reach {host}: {exc.__class__.__name__}") from None
        return Upstream(reader, writer, (host, ip, port)), ip

    async def resolve(self, host: str, granted: tuple[IPNetwork, ...]) -> str:
        """The address the connection is pinned to (screen_host), never the upstream proxy's; one in the
        operator's internal networks only where the sandbox's tenant is granted it (internal_networks.py)."""
        proxy = self.proxy
        if proxy is not None and host == proxy.host:
            raise Deny(403, "the upstream proxy is not a destination")
        try:
            ip = await screen_host(host, self.resolver, [*self.allow_networks, *self.internal.networks])
            if self._proxy_addresses is not None:
                self.internal.proxy.update(ipaddress.ip_address(a) for a in await self._proxy_addresses.get())
        except ResolveError as exc:
            raise Deny(502, exc.message) from None
        except DestinationRefused as exc:
            raise Deny(403, exc.message) from None
        except ProxyRefused as exc:
            raise Deny(502, str(exc)) from None
        if self.internal.is_proxy(ip):
            raise Deny(403, f"{host} resolves to the upstream proxy's address")
        if is_public_address(ip, self.allow_networks):
            return ip
        verdict = self.internal.verdict(ip, granted)
        if verdict == "not_granted":
            raise Deny(403, f"{host} resolves to {ip}, in an internal network this session's tenant is not "
                            "granted (an admin grants it: POST /v1/egress-grants)",
                       detail={"internal_network": "not_granted"})
        if verdict != "allowed":
            raise Deny(403, f"{host} resolves to {ip}, a node, control-plane, loopback or link-local "
                            "address the internal networks do not name explicitly")
        return ip

    async def _open(self, host: str, ip: str, port: int, tls: bool
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the pinned ``ip``: direct, or through the upstream proxy's tunnel (with TLS to
        ``host`` inside it)."""
        if self.proxy is None or self._proxy_addresses is None:
            return await asyncio.open_connection(ip, port, ssl=self.upstream_ssl if tls else None,
                                                 server_hostname=host if tls else None, limit=STREAM_LIMIT)
        reader, writer = await open_tunnel(self.proxy, self._proxy_addresses, ip, port, limit=STREAM_LIMIT)
        if tls:
            try:
                await writer.start_tls(self.upstream_ssl, server_hostname=host)
            except BaseException:
                writer.close()
                raise
        return reader, writer

"""Leaving through ``CAPSA_EGRESS_UPSTREAM_PROXY``: one HTTP CONNECT tunnel per upstream connection.

The broker has already applied the policy, resolved the destination itself and screened the answer; the
tunnel is opened to that pinned address (``CONNECT 203.0.113.7:443``), so the proxy cannot be made to
resolve the name again to something else. TLS to the destination runs inside the tunnel with the
destination's name for SNI and certificate checks; plain HTTP is tunnelled the same way. The proxy's
credentials go only into this CONNECT's ``Proxy-Authorization``; its answers are reduced to a status code
(a refusal's body, headers and reason phrase never reach the sandbox or a log).
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time

import h11

from capsa.common.destinations import ResolveError, SystemResolver
from capsa.common.egress_networks import UpstreamProxy

__all__ = ["ProxyAddresses", "ProxyRefused", "open_tunnel"]

_HEAD_LIMIT = 16 * 1024
_READ = 16 * 1024


class ProxyRefused(Exception):
    """The proxy could not be reached or did not open the tunnel; the message is safe to show."""


class ProxyAddresses:
    """The proxy host's addresses, resolved with the node's resolver and kept for ``ttl`` seconds."""

    def __init__(self, proxy: UpstreamProxy, ttl: float = 60.0) -> None:
        self.proxy, self.ttl = proxy, ttl
        self._stamp = float("-inf")
        self._addresses: list[str] = []

    async def get(self) -> list[str]:
        try:
            ipaddress.ip_address(self.proxy.host)
        except ValueError:
            pass
        else:
            return [self.proxy.host]
        if time.monotonic() - self._stamp > self.ttl:
            try:
                self._addresses = await SystemResolver().resolve(self.proxy.host)
            except ResolveError:
                raise ProxyRefused("the upstream proxy's name does not resolve") from None
            self._stamp = time.monotonic()
        return list(self._addresses)


def _authority(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def open_tunnel(proxy: UpstreamProxy, addresses: ProxyAddresses, ip: str, port: int, *,
                      proxy_ssl: ssl.SSLContext | None = None, limit: int = 64 * 1024
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``ip:port`` through the proxy, ready for the first byte of the destination's protocol.
    The caller bounds the time. Raises :class:`ProxyRefused` (or OSError while connecting)."""
    proxy_ip = (await addresses.get())[0]
    tls = proxy.scheme == "https"
    try:
        reader, writer = await asyncio.open_connection(
            proxy_ip, proxy.port, ssl=(proxy_ssl or ssl.create_default_context()) if tls else None,
            server_hostname=proxy.host if tls else None, limit=limit)
    except ssl.SSLError as exc:
        raise ProxyRefused(f"TLS to the upstream proxy failed: {exc.__class__.__name__}") from None
    except OSError as exc:
        raise ProxyRefused(f"cannot reach the upstream proxy: {exc.__class__.__name__}") from None
    try:
        target = _authority(ip, port)
        headers = [("host", target)]
        if proxy.authorization is not None:
            headers.append(("proxy-authorization", proxy.authorization.decode("latin-1")))
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_LIMIT)
        writer.write(conn.send(h11.Request(method="CONNECT", target=target, headers=headers)) or b"")
        await writer.drain()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(_READ)
                if not data:
                    raise ProxyRefused("the upstream proxy closed the connection before answering")
                conn.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if not isinstance(event, h11.Response):
                raise ProxyRefused("the upstream proxy answered something other than a response")
            break
        if not 200 <= event.status_code < 300:
            raise ProxyRefused(f"the upstream proxy refused the tunnel ({event.status_code})")
        if conn.trailing_data[0]:
            # Bytes after the 200 before the client spoke: no protocol the broker tunnels starts that way.
            raise ProxyRefused("the upstream proxy sent data before the tunnel was used")
    except h11.RemoteProtocolError:
        writer.close()
        raise ProxyRefused("the upstream proxy's answer is not valid HTTP") from None
    except BaseException:
        writer.close()
        raise
    return reader, writer

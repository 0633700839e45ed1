"""httpx transports whose every TCP connection goes to an address :func:`screen_host` allowed.

The screening happens in httpcore's network backend, at connect time: the name is resolved once, screened,
and the connection is opened to that very address (TLS still verifies the certificate against the name,
and SNI and ``Host`` carry the name). A connection is never opened to an address that was not screened,
redirects included, and there is no second lookup a rebinding DNS answer could change. Proxies from the
environment are ignored (a proxy would make the connection somewhere else than the screened address).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Sequence
from typing import Any

import httpcore
import httpx

from capsa.common.addresses import IPNetwork
from capsa.common.destinations import DestinationRefused, Resolver, screen_host

__all__ = ["ScreenedBackend", "pinned_transport"]


class ScreenedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to the address :func:`screen_host` returns for the requested host."""

    def __init__(self, resolver: Resolver, allow_networks: Sequence[IPNetwork] = (),
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.resolver = resolver
        self.allow_networks = tuple(allow_networks)
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        address = await screen_host(host, self.resolver, self.allow_networks)
        return await self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise DestinationRefused("connections to Unix sockets are not screened destinations")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


_LIMITS = httpx.Limits(max_connections=10, max_keepalive_connections=2)


def pinned_transport(resolver: Resolver, allow_networks: Sequence[IPNetwork] = (), *,
                     verify: ssl.SSLContext | bool = True, limits: httpx.Limits = _LIMITS
                     ) -> httpx.AsyncHTTPTransport:
    """An httpx transport (HTTP/1.1, no environment proxies) whose connections are screened and pinned.

    httpx has no public way to hand its pool a network backend, so the transport's pool is replaced by an
    identical one that has :class:`ScreenedBackend`; httpx's request and error mapping stay its own."""
    context = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
    transport = httpx.AsyncHTTPTransport(verify=context, trust_env=False, limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=context, max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=ScreenedBackend(resolver, allow_networks))
    return transport

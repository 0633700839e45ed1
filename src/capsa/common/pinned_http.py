"""httpx transports whose every TCP connection goes to an address :func:`screen_host` allowed.

The screening happens in httpcore's network backend, at connect time: the name is resolved once, screened,
and the connection is opened to that very address (TLS still verifies the certificate against the name,
and SNI and ``Host`` carry the name). A connection is never opened to an address that was not screened,
redirects included, and there is no second lookup a rebinding DNS answer could change. Proxies from the
environment are ignored (a proxy would make the connection somewhere else than the screened address).
"""

from __future__ import annotations

import importlib
import ssl
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import httpcore
import httpx

from capsa.common.addresses import IPNetwork
from capsa.common.destinations import DestinationRefused, Resolver, screen_host

__all__ = ["ScreenedBackend", "pinned_transport"]


class ScreenedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to the address :func:`screen_host` returns for the requested host."""

    _inner: Any

    def __init__(self, resolver: Resolver, allow_networks: Sequence[IPNetwork] = (),
                 inner: Any = None) -> None:
        """``inner`` (default: httpcore's AnyIO backend) opens the connection; an httpcore2 backend works
        the same way (the pool only calls these methods)."""
        self.resolver = resolver
        self.allow_networks = tuple(allow_networks)
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        address = await screen_host(host, self.resolver, self.allow_networks)
        stream: httpcore.AsyncNetworkStream = await self._inner.connect_tcp(
            address, port, timeout=timeout, local_address=local_address, socket_options=socket_options)
        return stream

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise DestinationRefused("connections to Unix sockets are not screened destinations")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


_CORE = {"httpx": "httpcore", "httpx2": "httpcore2"}
"""The connection library under each httpx flavour (authlib's client is built on httpx2)."""


def pinned_transport(resolver: Resolver, allow_networks: Sequence[IPNetwork] = (), *,
                     verify: ssl.SSLContext | bool = True, max_connections: int = 10,
                     max_keepalive: int = 2, http: ModuleType = httpx) -> Any:
    """An ``http.AsyncHTTPTransport`` (HTTP/1.1, no environment proxies) whose connections are screened and
    pinned; ``http`` is the httpx module the client using it is built on (``httpx`` or ``httpx2``).

    httpx has no public way to hand its pool a network backend, so the transport's pool is replaced by an
    identical one that has :class:`ScreenedBackend`; httpx's request and error mapping stay its own."""
    core = importlib.import_module(_CORE[http.__name__])
    context = verify if isinstance(verify, ssl.SSLContext) else http.create_ssl_context(verify=verify)
    limits = http.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive)
    transport = http.AsyncHTTPTransport(verify=context, trust_env=False, limits=limits)
    transport._pool = core.AsyncConnectionPool(
        ssl_context=context, max_connections=max_connections, max_keepalive_connections=max_keepalive,
        network_backend=ScreenedBackend(resolver, allow_networks, inner=core.AnyIOBackend()))
    return transport

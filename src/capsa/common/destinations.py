"""Screening a destination before capsa itself connects to it: one function for every outbound path.

The egress broker (a sandbox's upstreams), the node's approval webhooks and the control plane's OAuth
providers all resolve a name themselves, refuse the whole answer if any address in it is not public (see
:mod:`capsa.common.addresses`) unless an operator's allow-list covers it, and connect to the one address they
screened (pinned: there is no second lookup between the check and the connection for a rebinding answer to
slip into). :func:`screen_host` is that check; :mod:`capsa.common.pinned_http` pins it under httpx.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Protocol

from capsa.common.addresses import IPNetwork, is_ip_literal, is_public_address
from capsa.common.errors import CapsaError

__all__ = [
    "DestinationRefused",
    "ResolveError",
    "Resolver",
    "SystemResolver",
    "screen_host",
]


class ResolveError(CapsaError):
    code = "resolve_failed"
    status = 502


class DestinationRefused(CapsaError):
    """The destination is (or resolves to) an address capsa does not connect to on anyone's behalf."""

    code = "destination_refused"
    status = 422


class Resolver(Protocol):
    async def resolve(self, host: str) -> list[str]:
        """All addresses ``host`` has (strings); raise :class:`ResolveError` if it has none."""
        ...


class SystemResolver:
    """The host's own resolver (getaddrinfo)."""

    async def resolve(self, host: str) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ResolveError(f"cannot resolve {host}: {exc.strerror or exc}") from None
        out: list[str] = []
        for info in infos:
            addr = str(info[4][0])
            if addr not in out:
                out.append(addr)
        return out


async def screen_host(host: str, resolver: Resolver, allow_networks: Sequence[IPNetwork] = ()) -> str:
    """The one address to connect to for ``host`` (a name or an IP literal).

    Raises :class:`DestinationRefused` when any address the name has is not public (one bad answer taints
    the set: rebinding attacks mix a public and a private address) and not inside ``allow_networks`` (the
    operator's exceptions), or when ``host`` is a non-canonical numeric form (``0x7f.1``, ``2130706433``)
    that resolvers read as an address; :class:`ResolveError` when it has no address."""
    name = host.strip("[]")
    try:
        addresses = [str(ipaddress.ip_address(name))]
    except ValueError:
        if is_ip_literal(name):
            raise DestinationRefused(f"{host} is a numeric address in a non-canonical form") from None
        addresses = await resolver.resolve(name)
    if not addresses:
        raise ResolveError(f"{host} has no address")
    refused = [a for a in addresses if not is_public_address(a, allow_networks)]
    if refused:
        raise DestinationRefused(f"{host} resolves to a non-public address ({refused[0]})")
    return addresses[0]

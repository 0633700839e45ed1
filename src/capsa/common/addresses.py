"""Which destination addresses capsa's own outbound connections may reach: the egress broker's upstreams,
approval webhooks from the node, OAuth providers from the control plane (screened through
:func:`capsa.common.destinations.screen_host`).

Only globally routable unicast addresses pass, minus the ranges that reach back into private space (6to4
``2002::/16`` embeds any IPv4 address, including private ones; deprecated site-local ``fec0::/10``) and minus
the host's own addresses: a name that resolves to the node itself would reach the node's services from a
sandbox (or the control plane's from a provider's discovery document).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["is_ip_literal", "is_public_address", "node_addresses"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_REFUSED_V6 = (
    ipaddress.ip_network("2002::/16"),  # 6to4: the low bits name any IPv4 address, private ones too
    ipaddress.ip_network("fec0::/10"),  # site-local (deprecated, still routed inside some sites)
    ipaddress.ip_network("64:ff9b:1::/48"),  # local-use NAT64
)
_ADDR_TTL = 10.0
_addr_lock = threading.Lock()
_addr_cache: tuple[float, frozenset[IPAddress]] = (float("-inf"), frozenset())


def _read_local_addresses(fib_trie: Path, if_inet6: Path) -> frozenset[IPAddress]:
    """The addresses configured on this host's (this network namespace's) interfaces."""
    found: set[IPAddress] = set()
    try:
        last: str | None = None
        for line in fib_trie.read_text().splitlines():
            s = line.strip()
            if s.startswith("|--"):
                last = s[3:].strip()
            elif last is not None and s.endswith("host LOCAL"):
                found.add(ipaddress.IPv4Address(last))
    except (OSError, ValueError):
        pass
    try:
        for line in if_inet6.read_text().splitlines():
            hexaddr = line.split()[0]
            found.add(ipaddress.IPv6Address(int(hexaddr, 16)))
    except (OSError, ValueError, IndexError):
        pass
    return frozenset(found)


def node_addresses() -> frozenset[IPAddress]:
    """The node's own addresses, re-read at most every few seconds (interfaces come and go)."""
    global _addr_cache
    now = time.monotonic()
    with _addr_lock:
        stamp, addrs = _addr_cache
        if now - stamp > _ADDR_TTL:
            addrs = _read_local_addresses(Path("/proc/net/fib_trie"), Path("/proc/net/if_inet6"))
            _addr_cache = (now, addrs)
        return addrs


def is_public_address(addr: str, extra_allowed: Sequence[IPNetwork] = (),
                      own: frozenset[IPAddress] | None = None) -> bool:
    """True for globally routable unicast addresses that are not the node's own (``own``; default: read
    from the kernel), or addresses inside ``extra_allowed``."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in extra_allowed):
        return True
    if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and (ip.is_site_local or any(ip in n for n in _REFUSED_V6)):
        return False
    return ip not in (node_addresses() if own is None else own)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    else:
        return True
    # Also the forms inet_aton accepts (decimal, hex, octal, short dotted) that curl and others resolve.
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True

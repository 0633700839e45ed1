"""Which non-public addresses a sandbox may reach: the operator's ``CAPSA_EGRESS_ALLOW_NETWORKS``, intersected
with the networks the sandbox's tenant was granted (sent by the control plane with every sandbox start and
policy update).

An address in those networks is still refused when it belongs to what a sandbox must never reach through an
allow-list written for internal services, unless an entry of the operator's list names it *explicitly*:

- loopback, link-local (the metadata service 169.254.169.254 among them), unspecified, multicast, reserved:
  explicit means the entry lies wholly inside that range (``169.254.169.254/32``, ``127.0.0.0/8``), so
  ``0.0.0.0/0`` or ``10.0.0.0/8`` never opens them;
- the node's own addresses and the control plane's (``protect``): explicit means a single-address entry
  (``/32``, ``/128``) equal to the address;
- the upstream proxy's addresses: never (the proxy is the way out, not a destination).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from capsa.common.addresses import node_addresses
from capsa.common.egress_networks import IPAddress, IPNetwork, covers

__all__ = ["InternalNetworks", "Verdict"]

Verdict = Literal["allowed", "not_granted", "protected", "refused"]
"""``allowed``: in an operator network the sandbox is granted;
``not_granted``: in an operator network, but the tenant has no grant covering it; ``protected``: in one,
but a node, control-plane, proxy, loopback or link-local address not named explicitly; ``refused``: in
none of the operator's networks."""

_SENSITIVE: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "fe80::/10", "ff00::/8",
))


def _plain(addr: IPAddress) -> IPAddress:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass
class InternalNetworks:
    """The operator's networks and the addresses they may not open implicitly."""

    networks: tuple[IPNetwork, ...] = ()
    protected: set[IPAddress] = field(default_factory=set)
    """The control plane's addresses (the node's own are read from the kernel on each check)."""
    proxy: set[IPAddress] = field(default_factory=set)
    """The upstream proxy's addresses: never a destination."""

    def protect(self, addresses: Iterable[str]) -> None:
        self.protected.update(_plain(ipaddress.ip_address(a)) for a in addresses)

    def is_proxy(self, addr: str) -> bool:
        return _plain(ipaddress.ip_address(addr)) in self.proxy

    def _explicit(self, addr: IPAddress, own: frozenset[IPAddress]) -> bool | None:
        """None: ``addr`` is not sensitive; else whether an entry names it explicitly."""
        ranges = [r for r in _SENSITIVE if addr in r]
        if ranges:
            return any(net.subnet_of(r) for r in ranges for net in self.networks  # type: ignore[arg-type]
                       if net.version == r.version and addr in net)
        if addr in own or addr in self.protected:
            return any(net.num_addresses == 1 and addr in net for net in self.networks)
        return None

    def verdict(self, address: str, granted: Sequence[IPNetwork],
                own: frozenset[IPAddress] | None = None) -> Verdict:
        """Whether a sandbox whose tenant holds ``granted`` may connect to ``address`` (a non-public one:
        the caller checks public addresses first). ``own``: the node's addresses (default: the kernel's)."""
        addr = _plain(ipaddress.ip_address(address))
        if addr in self.proxy:
            return "protected"
        if not covers(self.networks, addr):
            return "refused"
        explicit = self._explicit(addr, node_addresses() if own is None else own)
        if explicit is False:
            return "protected"
        return "allowed" if covers(granted, addr) else "not_granted"

"""Per-sandbox network: a network namespace holding the VM's tap device and an nftables firewall.

The QEMU process runs inside the namespace and opens the tap by name. The guest gets the address
``guest_ip`` on a /30 whose other address (``gateway_ip``) is the tap's (:data:`GUEST_SUBNET`, the same
for every sandbox: each is alone in its namespace, see :meth:`NetworkManager._allocate`); the namespace
has no other link and no route anywhere, so the only things the guest can reach are the node services the
egress broker opens on the gateway address inside the namespace (DNS stub, HTTP, TLS, explicit proxy).
nftables in the namespace drops IPv6, spoofed sources, forwarding and everything else, counting each class
of drop so the node can audit it, and DNAT-s TCP 80/443 (to any address) to the broker.
Deleting the namespace removes the tap and the rules with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
import re
import secrets
from dataclasses import dataclass

from capsa.common.errors import CapsaError

__all__ = [
    "DROP_COUNTERS",
    "GUEST_SUBNET",
    "NetError",
    "NetworkManager",
    "SandboxNet",
    "ServicePorts",
    "render_ruleset",
]

GUEST_SUBNET = ipaddress.IPv4Network("10.231.0.0/30")
"""Every sandbox's guest subnet: gateway (the tap, the node's services) .1, guest .2. It never meets the
node's own networks: the namespace has no route out, and the broker connects upstream from the node's."""
_SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,48}$")
NETNS_PREFIX = "capsa-"
TABLE = "capsa"
DROP_COUNTERS = ("drop_ipv6", "drop_spoofed", "drop_nonip", "drop_forward", "drop_icmp", "drop_udp",
                 "drop_tcp", "drop_other", "drop_output")
_INGRESS_COUNTERS = ("drop_ipv6", "drop_spoofed", "drop_nonip")


class NetError(CapsaError):
    code = "network_error"
    status = 500


@dataclass(frozen=True)
class ServicePorts:
    """Ports of the node services inside every sandbox namespace (on the gateway address)."""

    http: int = 8080
    tls: int = 8443
    proxy: int = 3128
    dns: int = 53


@dataclass(frozen=True)
class SandboxNet:
    """What the runtime needs to attach a VM, and what the guest needs to configure itself."""

    sandbox_id: str
    netns: str
    tap: str
    guest_ip: str
    gateway_ip: str
    prefixlen: int
    mac: str
    ports: ServicePorts

    @property
    def dns_server(self) -> str:
        return self.gateway_ip

    @property
    def proxy_url(self) -> str:
        """For ``HTTP_PROXY``/``HTTPS_PROXY`` in the guest (tools that ignore it are DNAT-ed anyway)."""
        return f"http://{self.gateway_ip}:{self.ports.proxy}"

    def guest_config(self) -> dict[str, str]:
        return {"address": f"{self.guest_ip}/{self.prefixlen}", "gateway": self.gateway_ip,
                "dns": self.dns_server, "mac": self.mac, "proxy": self.proxy_url}


def render_ruleset(net: SandboxNet) -> str:
    """The nftables ruleset (text syntax) loaded inside the sandbox's namespace, once the tap exists.

    Two tables: a netdev one on the tap's ingress, which sees every frame before the IP stack (IPv6 is
    disabled in the namespace, so the stack would discard IPv6 silently, uncounted), and an inet one
    for addressing, DNAT and the local services."""
    g, gw, tap, p = net.guest_ip, net.gateway_ip, net.tap, net.ports
    inet_counters = "\n".join(f"  counter {n} {{ }}" for n in DROP_COUNTERS if n not in _INGRESS_COUNTERS)
    ingress_counters = "\n".join(f"  counter {n} {{ }}" for n in _INGRESS_COUNTERS)
    return f"""table netdev {TABLE}_tap {{
{ingress_counters}
  chain sbx_ingress {{
    type filter hook ingress device "{tap}" priority -500; policy accept;
    ether type ip6 counter name drop_ipv6 drop
    ether type ip ip saddr != {g} counter name drop_spoofed drop
    ether type arp arp saddr ip != {g} counter name drop_spoofed drop
    ether type != {{ ip, arp }} counter name drop_nonip drop
  }}
}}
table inet {TABLE} {{
{inet_counters}
  chain sbx_dnat {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{tap}" ip saddr {g} tcp dport 80 dnat ip to {gw}:{p.http}
    iifname "{tap}" ip saddr {g} tcp dport 443 dnat ip to {gw}:{p.tls}
  }}
  chain sbx_outside {{
    type filter hook prerouting priority dstnat + 10; policy accept;
    iifname "{tap}" ip daddr != {gw} counter name drop_forward drop
  }}
  chain sbx_input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state invalid counter name drop_other drop
    ct state established,related accept
    iifname "{tap}" ip saddr {g} ip daddr {gw} udp dport {p.dns} accept
    iifname "{tap}" ip saddr {g} ip daddr {gw} tcp dport {{ {p.http}, {p.tls}, {p.proxy} }} accept
    meta l4proto icmp counter name drop_icmp drop
    meta l4proto udp counter name drop_udp drop
    meta l4proto tcp counter name drop_tcp drop
    counter name drop_other drop
  }}
  chain sbx_forward {{
    type filter hook forward priority filter; policy drop;
    counter name drop_forward drop
  }}
  chain sbx_output {{
    type filter hook output priority filter; policy drop;
    oif "lo" accept
    ct state established,related accept
    counter name drop_output drop
  }}
}}
"""


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


async def _run(*argv: str, stdin: bytes | None = None, check: bool = True) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(stdin)
    rc = proc.returncode if proc.returncode is not None else -1
    if check and rc != 0:
        raise NetError(f"{' '.join(argv[:4])}… failed ({rc}): {err.decode(errors='replace').strip()}")
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


class NetworkManager:
    """Creates and destroys sandbox namespaces; every sandbox's guest is on :data:`GUEST_SUBNET`."""

    def __init__(self, ports: ServicePorts | None = None, netns_prefix: str = NETNS_PREFIX) -> None:
        self.ports = ports or ServicePorts()
        if not re.match(r"^[a-z][a-z0-9-]{0,15}$", netns_prefix):
            raise NetError(f"invalid namespace prefix {netns_prefix!r}")
        self.netns_prefix = netns_prefix
        self._used: dict[str, ipaddress.IPv4Network] = {}
        self._lock = asyncio.Lock()

    def netns_name(self, sandbox_id: str) -> str:
        return self.netns_prefix + sandbox_id

    @staticmethod
    def tap_name(sandbox_id: str) -> str:
        # Interface names are limited to 15 bytes; a digest keeps them unique and recognisable.
        return "cx" + hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]

    def _allocate(self, sandbox_id: str) -> ipaddress.IPv4Network:
        # One /30 for all: a sandbox's tap, rules and broker listeners live in its own namespace, so two
        # sandboxes' equal addresses never meet, and a guest restored from a snapshot (a template, a paused
        # session, a branch) keeps the address it was snapshotted with. Programs running at snapshot time
        # then see no address change: sockets made before the snapshot went on sending from the old
        # address (dropped as spoofed).
        subnet = GUEST_SUBNET
        self._used[sandbox_id] = subnet
        return subnet

    async def create(self, sandbox_id: str, *, tap_owner: int | None = None) -> SandboxNet:
        """Make the sandbox's namespace, tap and firewall. ``tap_owner``: uid allowed to open the tap
        (the unprivileged uid QEMU runs as); ``None`` leaves it to root."""
        if tap_owner is not None and not 0 <= tap_owner < 2**32 - 1:
            raise NetError(f"invalid tap owner uid {tap_owner}", code="invalid_request", status=422)
        if not _SANDBOX_ID_RE.match(sandbox_id):
            raise NetError(f"invalid sandbox id {sandbox_id!r}", code="invalid_request", status=422)
        netns = self.netns_name(sandbox_id)
        async with self._lock:
            if sandbox_id in self._used or _netns_exists(netns):
                raise NetError(f"network of {sandbox_id} already exists", code="conflict", status=409)
            subnet = self._allocate(sandbox_id)
        hosts = list(subnet.hosts())
        mac = "02:ca:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(4))
        net = SandboxNet(sandbox_id, netns, self.tap_name(sandbox_id), str(hosts[1]), str(hosts[0]),
                         subnet.prefixlen, mac, self.ports)
        try:
            await _run("ip", "netns", "add", netns)
            # Sysctls first: the tap must never get an IPv6 link-local address.
            await _run("ip", "netns", "exec", netns, "sysctl", "-q", "-w",
                       "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                       "net.ipv4.ip_forward=0", "net.ipv4.conf.all.rp_filter=1",
                       "net.ipv4.conf.default.rp_filter=1")
            batch = (f"link set lo up\n"
                     f"tuntap add dev {net.tap} mode tap"
                     + (f" user {tap_owner}" if tap_owner is not None else "") + "\n"
                     f"addr add {net.gateway_ip}/{net.prefixlen} dev {net.tap}\n")
            # The tap stays down until the rules are in: no frame passes unfiltered.
            await _run("ip", "-n", netns, "-batch", "-", stdin=batch.encode())
            await _run("ip", "netns", "exec", netns, "nft", "-f", "-",
                       stdin=f"flush ruleset\n{render_ruleset(net)}".encode())
            await _run("ip", "-n", netns, "link", "set", net.tap, "up")
        except BaseException:
            await self._remove(sandbox_id, netns)
            raise
        return net

    async def destroy(self, net: SandboxNet) -> None:
        """Remove the namespace (and with it the tap and the rules) and free the subnet. Idempotent.

        The broker must have closed its sockets in the namespace first, or the kernel keeps the
        namespace (and the tap) alive behind the removed name."""
        await self._remove(net.sandbox_id, net.netns)

    async def _remove(self, sandbox_id: str, netns: str) -> None:
        try:
            if _netns_exists(netns):
                await _run("ip", "netns", "del", netns)
        finally:
            async with self._lock:
                self._used.pop(sandbox_id, None)

    async def drop_counters(self, net: SandboxNet) -> dict[str, int]:
        """Packets dropped so far, per class (see ``DROP_COUNTERS``)."""
        _, out, _ = await _run("ip", "netns", "exec", net.netns, "nft", "-j", "list", "counters")
        result: dict[str, int] = {}
        for item in json.loads(out).get("nftables", []):
            counter = item.get("counter")
            if counter:
                result[str(counter["name"])] = int(counter["packets"])
        return result

    async def leftovers(self, net: SandboxNet) -> list[str]:
        """Anything of this sandbox's network still present on the node (empty after destroy)."""
        found: list[str] = []
        _, netns_list, _ = await _run("ip", "netns", "list")
        if any(line.split()[0] == net.netns for line in netns_list.splitlines() if line.strip()):
            found.append(f"netns {net.netns}")
        rc, _, _ = await _run("ip", "link", "show", "dev", net.tap, check=False)
        if rc == 0:
            found.append(f"link {net.tap}")
        async with self._lock:
            if net.sandbox_id in self._used:
                found.append(f"subnet of {net.sandbox_id}")
        return found

    async def cleanup_stale(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Remove namespaces with this manager's prefix left by a crashed node agent (except the sandbox
        ids in ``keep``). Every node agent on a host must use its own prefix."""
        _, out, _ = await _run("ip", "netns", "list")
        removed: list[str] = []
        for line in out.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(self.netns_prefix) and name[len(self.netns_prefix):] not in keep:
                await _run("ip", "netns", "del", name, check=False)
                removed.append(name)
        return removed

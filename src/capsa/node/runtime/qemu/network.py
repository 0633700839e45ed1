"""The guest side of a sandbox NIC: opening its tap for QEMU and giving the guest its address."""

from __future__ import annotations

from capsa.node.guestlink.client import GuestClient
from capsa.node.runtime.base import BootError, TapNetwork

__all__ = ["configure_guest_network", "open_tap"]


def open_tap(network: TapNetwork) -> int:
    """A descriptor of the sandbox's tap (QEMU cannot open one itself: it has no privileges)."""
    from capsa.node.net.wire import open_tap as open_in_netns

    return open_in_netns(network.netns, network.tap)


async def configure_guest_network(client: GuestClient, network: TapNetwork) -> None:
    """Give the guest NIC (found by its MAC: the guest has no udev to name it) the sandbox's address.

    Idempotent, so it also serves a guest restored from a snapshot taken on another subnet: the old
    address, route and neighbour entries (the old tap's MAC) go first."""
    gateway = network.gateway_ip
    dns = str(getattr(network, "dns_server", gateway))
    script = (
        'set -e; dev=""; for d in /sys/class/net/*; do '
        '[ "$(cat "$d/address")" = "$1" ] && dev="${d##*/}"; done; '
        '[ -n "$dev" ] || { echo "no NIC with MAC $1" >&2; exit 1; }; '
        'ip link set dev "$dev" up; ip addr flush dev "$dev"; ip neigh flush dev "$dev"; '
        'ip addr add "$2" dev "$dev"; ip route replace default via "$3" dev "$dev"; '
        'printf "nameserver %s\\n" "$4" > /etc/resolv.conf'
    )
    argv = ["sh", "-c", script, "capsa-net", network.mac.lower(), f"{network.guest_ip}/{network.prefixlen}",
            gateway, dns]
    # Generous: a guest restored with busy programs in it (a browser's timers all firing after the
    # restore) may take a while under TCG to schedule the shell.
    result = await client.exec(argv, timeout=120)
    if result.exit_code != 0:
        why = "timed out" if getattr(result, "timed_out", False) else result.stderr.decode(errors="replace")
        raise BootError(f"configuring the guest network failed: {why}")

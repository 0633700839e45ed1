"""A userspace NIC: plugs a sandbox's tap into a tap in another namespace, frame for frame.

This is what QEMU's virtio-net does with the tap, minus the VM: it lets the node check a sandbox's network
(and the test suite attack it) from a namespace standing in for the guest, through exactly the same tap,
addresses and nftables rules a VM would see.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import struct
import subprocess
import threading
from pathlib import Path

from capsa.node.net.nsexec import run_in_netns
from capsa.node.net.sandbox_net import SandboxNet

__all__ = ["GuestNamespace", "TapWire", "open_tap"]

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def open_tap(netns: str | None, name: str) -> int:
    """Open (creating it if needed) the tap ``name`` inside ``netns``; returns the queue fd."""

    def attach() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
        except BaseException:
            os.close(fd)
            raise
        return fd

    return run_in_netns(netns, attach)


class TapWire:
    """Copies Ethernet frames between two tap queues until :meth:`close`."""

    def __init__(self, a: int, b: int) -> None:
        self._fds = (a, b)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pump, args=(a, b), daemon=True, name="tapwire-ab"),
                         threading.Thread(target=self._pump, args=(b, a), daemon=True, name="tapwire-ba")]
        for t in self._threads:
            t.start()

    def _pump(self, src: int, dst: int) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([src], [], [], 0.1)
            if not ready:
                continue
            try:
                frame = os.read(src, 65536)
                os.write(dst, frame)
            except OSError:
                # EIO while the other side's link is down: drop the frame like a cable would.
                continue

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for fd in self._fds:
            os.close(fd)


class GuestNamespace:
    """A network namespace configured the way a sandbox's guest configures itself, wired to the
    sandbox's tap. ``ip netns exec <name> …`` then runs a program "inside the guest"."""

    def __init__(self, net: SandboxNet, name: str, guest_tap: str = "eth0") -> None:
        self.net, self.name, self.guest_tap = net, name, guest_tap
        self._wire: TapWire | None = None
        self._etc = Path("/etc/netns") / name

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", "-n", self.name, *args], check=True, capture_output=True)

    def start(self) -> GuestNamespace:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        try:
            # The guest tap is non-persistent: it lives as long as our queue fd.
            guest_fd = open_tap(self.name, self.guest_tap)
            try:
                sandbox_fd = open_tap(self.net.netns, self.net.tap)
            except BaseException:
                os.close(guest_fd)
                raise
            self._wire = TapWire(sandbox_fd, guest_fd)
            self._ip("link", "set", "lo", "up")
            self._ip("link", "set", self.guest_tap, "address", self.net.mac)
            self._ip("addr", "add", f"{self.net.guest_ip}/{self.net.prefixlen}", "dev", self.guest_tap)
            self._ip("link", "set", self.guest_tap, "up")
            self._ip("route", "add", "default", "via", self.net.gateway_ip)
            self._etc.mkdir(parents=True, exist_ok=True)
            (self._etc / "resolv.conf").write_text(f"nameserver {self.net.dns_server}\n")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self._etc)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

"""Whole-guest operations: health, clock and entropy refresh after a snapshot restore, power off."""

from __future__ import annotations

import fcntl
import os
import platform
import signal
import socket
import struct
import time
from typing import Any

from capsa.guest.channel import Stream
from capsa.guest.errors import OpError, from_os_error
from capsa.guest.protocol import PROTOCOL_VERSION

__all__ = ["GUEST_VERSION", "System"]

GUEST_VERSION = "0.1.0"

# <linux/random.h>: _IOW('R', 0x03, int[2]) and _IO('R', 0x07)
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MAX_ENTROPY = 4096


def _system_uptime() -> float | None:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class System:
    def __init__(self, *, allow_clock: bool = True, allow_poweroff: bool = False, instance: str = "") -> None:
        self.started = time.monotonic()
        self.instance = instance
        self.allow_clock = allow_clock
        self.allow_poweroff = allow_poweroff
        self.reseeds = 0
        """Reseeds done (both ioctls succeeded) since this daemon started: part of a snapshot, so a restore
        shows whether the host reseeded the copy (``health``'s ``rng_reseeds``)."""

    def op_health(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        stream.result({
            "status": "ok",
            "version": GUEST_VERSION,
            "protocol": PROTOCOL_VERSION,
            "instance": self.instance,
            "pid": os.getpid(),
            "uptime": _system_uptime(),
            "daemon_uptime": time.monotonic() - self.started,
            "kernel": platform.release(),
            "hostname": socket.gethostname(),
            "python": platform.python_version(),
            "time_ns": time.time_ns(),
            "uid": os.geteuid(),
            "rng_reseeds": self.reseeds,
        })

    def op_set_clock(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        unix_ns = args.get("unix_ns")
        if isinstance(unix_ns, bool) or not isinstance(unix_ns, int) or not 0 < unix_ns < 1 << 63:
            raise OpError("bad_request", "unix_ns must be a positive integer (nanoseconds since the epoch)")
        if not self.allow_clock:
            raise OpError("unsupported", "this daemon was started with --no-clock")
        before = time.time_ns()
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, unix_ns)
        except OSError as exc:
            raise from_os_error(exc, "clock_settime") from None
        stream.result({"previous_ns": before, "step_ns": unix_ns - before})

    def op_reseed(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Mix host bytes into the kernel pool and force the CRNG to reseed from it.

        Both steps are needed: two restores of one snapshot otherwise keep producing identical
        random numbers (measured; adding entropy alone did not change the CRNG output).
        """
        if not 16 <= len(data) <= MAX_ENTROPY:
            raise OpError("bad_request", f"send between 16 and {MAX_ENTROPY} bytes of entropy as frame data")
        padded = data + b"\0" * (-len(data) % 4)
        request = struct.pack("ii", len(data) * 8, len(data)) + padded
        try:
            with open("/dev/random", "wb", buffering=0) as dev:
                fcntl.ioctl(dev.fileno(), RNDADDENTROPY, request)
                fcntl.ioctl(dev.fileno(), RNDRESEEDCRNG)
        except OSError as exc:
            raise from_os_error(exc, "/dev/random") from None
        self.reseeds += 1
        stream.result({"bytes": len(data), "reseeds": self.reseeds})

    def op_set_hostname(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        name = args.get("name")
        if (not isinstance(name, str) or not 0 < len(name) <= 64
                or not all(c.isascii() and (c.isalnum() or c in "-.") for c in name)
                or name.startswith(("-", ".")) or name.endswith(("-", "."))):
            raise OpError("bad_request", "name must be a hostname (letters, digits, '-' and '.', up to 64)")
        if not self.allow_clock:  # a daemon on a host must not rename the host either
            raise OpError("unsupported", "this daemon runs on a host (--no-clock); not renaming it")
        try:
            socket.sethostname(name)
        except OSError as exc:
            raise from_os_error(exc, "sethostname") from None
        stream.result({"hostname": name})

    def op_poweroff(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        if not self.allow_poweroff or os.getppid() != 1:
            raise OpError("unsupported", "power off is only available under the capsa guest init")
        stream.result({})
        # The init (our parent, PID 1) syncs and powers the VM off on SIGTERM.
        os.kill(1, signal.SIGTERM)

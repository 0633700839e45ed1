"""systemd's readiness protocol (sd_notify): ``READY=1`` once a service serves, ``STOPPING=1`` when it
begins to stop, sent as one datagram to the unix socket named by ``NOTIFY_SOCKET`` (set by systemd for a
``Type=notify`` unit; absent elsewhere, and then nothing is sent).

Written here on the standard library: the protocol is one ``sendto`` on a datagram socket, and none of
the packages that wrap it is in capsa's environment or fits well: ``systemd-python`` and ``cysystemd``
bind libsystemd (headers and a compiler to install), ``sdnotify``'s last release is from 2017. A
dependency for a dozen lines is not worth it.
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify"]

log = logging.getLogger(__name__)


def notify(*assignments: str) -> bool:
    """Send ``assignments`` (``"READY=1"``, ``"STATUS=..."``) to the service manager when ``NOTIFY_SOCKET``
    is set; returns whether they were sent. Never raises: a service manager that cannot be told is logged,
    and the service goes on (systemd then acts on its own timeouts)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET %r is not a unix socket path: not notifying", address)
        return False
    message = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", address.lstrip("\0"), exc)
        return False
    return True

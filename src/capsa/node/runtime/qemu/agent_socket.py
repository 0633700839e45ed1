"""Connecting to a VM's guest-agent socket, and making sure the other end is that VM's QEMU.

The socket lives in ``run/``, the one directory the VM user may write: a compromised QEMU could replace
``agent.sock`` with a link to another VM's socket, and the node (root) would follow it and run this
sandbox's commands in someone else's guest. So after connecting, the listener's credentials
(``SO_PEERCRED``: who called ``listen()``) must be this VM's QEMU process.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

from capsa.node.guestlink.client import GuestClient

__all__ = ["WrongPeer", "connect_agent", "peer_credentials"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_READ_LIMIT = 256 * 1024


class WrongPeer(OSError):
    """The agent socket was not served by the VM's own QEMU."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that listens on the other end of a connected Unix socket."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


async def connect_agent(path: Path, *, pid: int | None, uid: int | None) -> GuestClient:
    """A :class:`GuestClient` on ``path`` once the peer is QEMU ``pid`` running as ``uid`` (None: not
    checked). Raises :class:`WrongPeer` (and closes the connection) otherwise."""
    reader, writer = await asyncio.open_unix_connection(str(path), limit=_READ_LIMIT)
    sock = writer.get_extra_info("socket")
    try:
        peer_pid, peer_uid, _ = peer_credentials(sock)
        if (pid is not None and peer_pid != pid) or (uid is not None and peer_uid != uid):
            raise WrongPeer(f"{path} is served by pid {peer_pid} uid {peer_uid}, not the VM's QEMU "
                            f"(pid {pid}, uid {uid})")
    except BaseException:
        writer.close()
        raise
    return GuestClient(reader, writer)

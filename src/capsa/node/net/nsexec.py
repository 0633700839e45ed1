"""Running a function with the calling thread inside another network namespace.

The node's services (egress broker, DNS stub) live in the node's own namespace but listen inside each
sandbox's namespace: a socket stays in the namespace it was created in, so the broker opens its listening
sockets from a short-lived thread that has joined the sandbox's namespace. This needs no forwarding or
veth between namespaces, and a connection's namespace identifies its sandbox.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

from capsa.common.errors import CapsaError

__all__ = ["NetnsError", "netns_path", "open_listener", "run_in_netns"]

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(CapsaError):
    code = "netns_error"
    status = 500


def netns_path(name: str) -> str:
    return f"/run/netns/{name}"


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns failed: {os.strerror(err)}")


def run_in_netns(netns: str | None, fn: Callable[[], T]) -> T:
    """Call ``fn`` on a fresh thread that has joined ``netns`` (``None``: the current namespace)."""
    if netns is None:
        return fn()
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                target = os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                os.close(own)
                raise NetnsError(f"network namespace {netns} does not exist", code="netns_missing") from None
            try:
                _setns(target)
                try:
                    result.append(fn())
                finally:
                    _setns(own)
            finally:
                os.close(target)
                os.close(own)
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=body, name=f"netns-{netns}", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def open_listener(netns: str | None, host: str, port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A bound (and, for TCP, listening) non-blocking socket created inside ``netns``."""

    def make() -> socket.socket:
        # An explicit protocol number: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
        # IPPROTO_TCP, and without it Nagle + delayed ACKs add ~40 ms to every kept-alive response.
        proto = socket.IPPROTO_TCP if kind == socket.SOCK_STREAM else socket.IPPROTO_UDP
        sock = socket.socket(socket.AF_INET, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            if kind == socket.SOCK_STREAM:
                sock.listen(512)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    try:
        return run_in_netns(netns, make)
    except OSError as exc:
        raise NetnsError(f"cannot listen on {host}:{port} in {netns or 'the node namespace'}: "
                         f"{exc.strerror or exc}") from None

"""TCP ports inside the guest: a connection to 127.0.0.1:<port> relayed over one channel stream.

``tcp_open`` (meta ``port``, optional ``connect_timeout``) connects, answers EVENT {"connected": true},
then relays bytes both ways: host DATA frames are written to the socket, host END shuts the socket's write
side (half-close; the guest keeps reading), and what the socket sends comes back as DATA frames (within the
stream's credit). When the server closes its side the op answers RESULT {"bytes_in", "bytes_out"}; a
CANCEL from the host closes the socket. A port nothing listens on fails with ``port_unreachable``.

This is what the node's port tunnel and the control plane's HTTP/WebSocket proxy ride on: the sandbox needs
no network device and no egress policy for it, only its loopback interface.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
from typing import Any

from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.errors import OpError
from capsa.guest.protocol import CHUNK_SIZE, Kind

__all__ = ["op_tcp_open"]

_UNREACHABLE = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH,
                          errno.ETIMEDOUT, errno.ECONNABORTED})


def _port(args: dict[str, Any]) -> int:
    port = args.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise OpError("bad_request", "port must be an integer between 1 and 65535")
    return port


def _timeout(args: dict[str, Any]) -> float:
    value = args.get("connect_timeout", 10.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 300:
        raise OpError("bad_request", "connect_timeout must be a number of seconds in (0, 300]")
    return float(value)


def _connect(port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except TimeoutError:
        raise OpError("port_unreachable", f"connecting to port {port} timed out ({timeout:g} s)") from None
    except OSError as exc:
        if exc.errno in _UNREACHABLE:
            raise OpError("port_unreachable", f"nothing accepts connections on port {port} "
                                              f"({exc.strerror or exc})") from None
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def op_tcp_open(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    port = _port(args)
    sock = _connect(port, _timeout(args))
    counts = {"in": 0, "out": 0}
    closed = threading.Event()

    def hang_up() -> None:
        closed.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    stream.on_cancel(hang_up)
    writer = threading.Thread(target=_to_socket, args=(stream, sock, counts), daemon=True,
                              name=f"capsa-tcp-in-{stream.id}")
    try:
        stream.send(Kind.EVENT, {"connected": True, "port": port})
        writer.start()
        while not closed.is_set():
            try:
                chunk = sock.recv(CHUNK_SIZE)
            except OSError:
                break
            if not chunk:
                break
            counts["out"] += len(chunk)
            stream.send_data(chunk)
    finally:
        closed.set()
        stream.stop_inbox()  # the writer thread wakes up and ends
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        if writer.is_alive():
            writer.join(5)
        sock.close()
    if stream.cancelled.is_set():
        raise ChannelGone("connection closed by the host")
    stream.result({"bytes_in": counts["in"], "bytes_out": counts["out"]})


def _to_socket(stream: Stream, sock: socket.socket, counts: dict[str, int]) -> None:
    """Host DATA -> socket; host END -> half-close. Credit is returned only once the socket took the bytes."""
    try:
        for frame in stream.frames():
            if frame.kind == Kind.DATA:
                try:
                    sock.sendall(frame.data)
                except OSError:
                    return  # the reading side sees the socket fail too and ends the op
                counts["in"] += len(frame.data)
                stream.consumed(len(frame.data))
            elif frame.kind == Kind.END:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
    except (ChannelGone, OpError):
        return

"""A TCP connection to a port inside the guest (``tcp_open``), carried on one call stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from capsa.guest.protocol import Kind
from capsa.guest.results import opt_int
from capsa.node.guestlink.connection import GuestConnection
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.streams import CallStream

__all__ = ["TcpTunnel"]


class TcpTunnel:
    """A TCP connection to a port inside the guest (``tcp_open``), carried on one channel stream.

    ``write`` waits for the guest's credit (so a fast sender is held back by a slow port), ``read`` yields
    what the port sent, within the client's credit (acknowledged as the caller consumes it), until the
    server closes its side. ``end`` half-closes (the server reads EOF); ``close`` drops the connection."""

    def __init__(self, link: GuestConnection, stream: CallStream, port: int) -> None:
        self._link = link
        self._stream = stream
        self.port = port
        self.closed = False
        self.bytes_in: int | None = None
        self.bytes_out: int | None = None
        """Byte counts the guest reported when the server closed (None until then)."""

    async def write(self, data: bytes) -> None:
        if data and not await self._stream.send_data(data):
            raise GuestError("port_unreachable", f"port {self.port} closed the connection")

    async def end(self) -> None:
        """Half-close: the server reads EOF; what it still sends keeps coming through ``read``."""
        if not self._stream.done:
            await self._link.send(Kind.END, self._stream.id)

    async def read(self) -> AsyncGenerator[bytes, None]:
        """What the port sends, until it closes its side."""
        while not self.closed:
            frame = await self._stream.next()
            if frame.kind == Kind.DATA:
                if frame.data:
                    yield frame.data
            elif frame.kind == Kind.RESULT:
                self.bytes_in = opt_int(frame.meta.get("bytes_in"))
                self.bytes_out = opt_int(frame.meta.get("bytes_out"))
                self.closed = True
                self._link.forget(self._stream)
                return

    async def close(self) -> None:
        """Drop the connection (the guest closes the socket); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        await self._link.abandon(self._stream)

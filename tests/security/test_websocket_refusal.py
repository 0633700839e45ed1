"""Issue 27 H3: an app in a sandbox answering a WebSocket upgrade with an endless refusal cannot grow the
control plane. The WebSocket client the ports proxy and the CDP client use (``capsa.common.websocket``)
reads at most :data:`MAX_REFUSAL_BYTES` of a refused upgrade's body and gives up on a handshake past its
deadline, against a real loopback server that answers 400 with an endless body, or dribbles its headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from capsa.common.websocket import (
    MAX_REFUSAL_BYTES,
    READ_SIZE,
    SocketStream,
    WebSocketClient,
    WebSocketHandshakeFailed,
    WebSocketRejected,
)

pytestmark = pytest.mark.timeout(60)

_SMALL_BUFFER = 16 * 1024
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Counted:
    """A :class:`SocketStream` that counts the bytes the client took from it."""

    def __init__(self, inner: SocketStream) -> None:
        self.inner = inner
        self.read_bytes = 0

    async def read(self) -> bytes:
        data = await self.inner.read()
        self.read_bytes += len(data)
        return data

    async def write(self, data: bytes) -> None:
        await self.inner.write(data)

    async def end(self) -> None:
        await self.inner.end()

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """A loopback server running ``handler`` per connection, with a small send buffer; yields its port and
    a one-item list counting the bytes it managed to hand to the kernel."""
    sent = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SMALL_BUFFER)
        writer.transport.set_write_buffer_limits(high=_SMALL_BUFFER)
        with contextlib.suppress(ConnectionError, OSError):
            await reader.readuntil(b"\r\n\r\n")  # the upgrade request
            real_write = writer.write

            def counting_write(data: bytes | bytearray | memoryview) -> None:
                sent[0] += len(data)
                real_write(data)

            writer.write = counting_write  # type: ignore[method-assign]
            await handler(reader, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], sent
    finally:
        server.close()


async def _client_stream(port: int) -> _Counted:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SMALL_BUFFER)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_SIZE)
    return _Counted(SocketStream(reader, writer))


async def _endless_400(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 100000000000\r\n\r\n")
    chunk = b"x" * 65536
    while True:
        writer.write(chunk)
        await writer.drain()


async def _dribbled_head(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 400 Bad Request\r\nX-Slow: ")
    while True:
        writer.write(b"a")
        await writer.drain()
        await asyncio.sleep(0.05)


async def test_an_endless_refusal_body_is_read_up_to_the_cap() -> None:
    async with _server(_endless_400) as (port, sent):
        stream = await _client_stream(port)
        try:
            async with asyncio.timeout(20):  # the old client read on for ever: this fails it
                with pytest.raises(WebSocketRejected) as refused:
                    await WebSocketClient.connect(stream, "localhost", "/ws", timeout=10)
        finally:
            await stream.aclose()
        await asyncio.sleep(0.2)  # whatever the server still manages to push after the close
        print(f"server sent {sent[0]} bytes, client read {stream.read_bytes}")
    assert refused.value.status == 400 and refused.value.truncated
    assert len(refused.value.body) == MAX_REFUSAL_BYTES
    # What the client took from the socket: the cap, plus at most one read past it.
    assert stream.read_bytes <= MAX_REFUSAL_BYTES + READ_SIZE + 1024
    # What the server got out: that, plus the reader's and the kernel's buffers (a few hundred KiB).
    assert sent[0] < 4 * 1024 * 1024


async def test_a_dribbled_head_ends_at_the_handshake_deadline() -> None:
    async with _server(_dribbled_head) as (port, sent):
        stream = await _client_stream(port)
        try:
            async with asyncio.timeout(20):
                with pytest.raises(WebSocketHandshakeFailed, match="within 1 s"):
                    await WebSocketClient.connect(stream, "localhost", "/ws", timeout=1.0)
        finally:
            await stream.aclose()
        print(f"server sent {sent[0]} bytes, client read {stream.read_bytes}")
    assert 0 < stream.read_bytes < 16 * 1024


async def test_an_oversized_head_is_refused_as_bad_http() -> None:
    async def huge_head(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nX-Big: ")
        while True:
            writer.write(b"a" * 4096)
            await writer.drain()

    async with _server(huge_head) as (port, _):
        stream = await _client_stream(port)
        try:
            async with asyncio.timeout(20):
                with pytest.raises(WebSocketHandshakeFailed, match="not valid HTTP"):
                    await WebSocketClient.connect(stream, "localhost", "/ws", timeout=10)
        finally:
            await stream.aclose()
    assert stream.read_bytes <= 16 * 1024 + READ_SIZE

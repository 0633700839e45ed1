"""A small asyncio WebSocket client (wsproto) over any byte stream, and the byte streams it runs on.

The control plane uses it to reach a node's port tunnel (over TCP or the node's Unix socket) and to speak
WebSocket to a server inside a sandbox (over that tunnel); the SDK uses it for the public port tunnel. A
:class:`ByteStream` is the one seam: a socket (:class:`SocketStream`) or a tunnel
(:class:`capsa.common.port_tunnel.PortTunnel`).

The handshake is bounded, as its peer may be an app in a sandbox: the whole upgrade has a deadline
(:data:`HANDSHAKE_TIMEOUT`), the response's head is held to h11's 16 KiB, and of a refusal's body at most
:data:`MAX_REFUSAL_BYTES` is read (:class:`WebSocketRejected` says when it was cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from capsa.common.errors import CapsaError

__all__ = ["HANDSHAKE_TIMEOUT", "MAX_REFUSAL_BYTES", "ByteStream", "SocketStream", "WebSocketClient",
           "WebSocketHandshakeFailed", "WebSocketRejected", "receive_first_json", "upgrade"]

READ_SIZE = 256 * 1024
MAX_MESSAGE = 16 * 1024 * 1024
"""The largest message a client assembles from fragments (the peer is told 1009 past it)."""
HANDSHAKE_TIMEOUT = 60.0
"""Seconds the whole upgrade (request sent, response head and a refusal's body read) may take."""
MAX_REFUSAL_BYTES = 64 * 1024
"""The most of a refused upgrade's response body that is read; the rest is left unread."""


class ByteStream(Protocol):
    """A bidirectional byte stream: ``read`` answers b"" at EOF."""

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None:
        """Half-close: no more writes; reading goes on."""

    async def aclose(self) -> None: ...


class SocketStream:
    """An asyncio stream pair as a :class:`ByteStream`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, url_host: str, port: int, *, tls: bool = False,
                      timeout: float = 10.0) -> SocketStream:  # noqa: ASYNC109
        context = ssl.create_default_context() if tls else None
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(url_host, port, ssl=context, limit=READ_SIZE)
        return cls(reader, writer)

    @classmethod
    async def connect_unix(cls, path: str, *, timeout: float = 10.0) -> SocketStream:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path, limit=READ_SIZE)
        return cls(reader, writer)

    async def read(self) -> bytes:
        return await self._reader.read(READ_SIZE)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def end(self) -> None:
        if self._writer.can_write_eof():
            self._writer.write_eof()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            await self._writer.wait_closed()


class WebSocketRejected(Exception):
    """The server answered the upgrade with an HTTP response instead of 101. ``body``: its body, or its
    first :data:`MAX_REFUSAL_BYTES` when ``truncated`` (the rest was never read)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, *,
                 truncated: bool = False) -> None:
        super().__init__(f"websocket upgrade refused with HTTP {status}")
        self.status = status
        self.headers = headers
        self.body = body
        self.truncated = truncated


class WebSocketHandshakeFailed(ConnectionError):
    """The upgrade did not complete: past its deadline, or the server's answer was not valid HTTP (its
    head longer than h11 holds, 16 KiB)."""


class WebSocketClient:
    """The client end of one WebSocket connection. Use :meth:`connect`; one reader at a time."""

    def __init__(self, stream: ByteStream, ws: WSConnection, subprotocol: str | None,
                 pending: list[Event]) -> None:
        self._stream = stream
        self._ws = ws
        self.subprotocol = subprotocol
        self._pending = pending
        self._parts: list[bytes | str] = []
        self._size = 0
        self._write_lock = asyncio.Lock()
        self.close_code: int | None = None
        self.close_reason: str = ""
        self._closed = False

    @classmethod
    async def connect(cls, stream: ByteStream, host: str, target: str, *,
                      headers: Sequence[tuple[str, str]] = (), subprotocols: Sequence[str] = (),
                      timeout: float = HANDSHAKE_TIMEOUT,  # noqa: ASYNC109
                      max_refusal: int = MAX_REFUSAL_BYTES) -> WebSocketClient:
        """Upgrade ``stream`` within ``timeout`` seconds: raises :class:`WebSocketRejected` (at most
        ``max_refusal`` bytes of its body read), :class:`WebSocketHandshakeFailed` (deadline, bad HTTP)
        or ConnectionError at EOF. The caller closes ``stream`` when it raises."""
        try:
            async with asyncio.timeout(timeout):
                return await cls._handshake(stream, host, target, headers, subprotocols, max_refusal)
        except TimeoutError:
            raise WebSocketHandshakeFailed(f"no websocket handshake within {timeout:g} s") from None
        except RemoteProtocolError as exc:
            raise WebSocketHandshakeFailed(f"the websocket handshake's answer is not valid HTTP: {exc}"
                                           ) from None

    @classmethod
    async def _handshake(cls, stream: ByteStream, host: str, target: str,
                         headers: Sequence[tuple[str, str]], subprotocols: Sequence[str],
                         max_refusal: int) -> WebSocketClient:
        ws = WSConnection(ConnectionType.CLIENT)
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        await stream.write(ws.send(Request(host=host, target=target, extra_headers=extra,
                                           subprotocols=list(subprotocols))))
        rejected: RejectConnection | None = None
        body = bytearray()
        while True:
            data = await stream.read()
            ws.receive_data(data or None)
            events = list(ws.events())
            for i, event in enumerate(events):
                if isinstance(event, AcceptConnection):
                    return cls(stream, ws, event.subprotocol, events[i + 1:])
                if isinstance(event, RejectConnection):
                    rejected = event
                    if not event.has_body:
                        raise WebSocketRejected(event.status_code, list(event.headers), b"")
                elif isinstance(event, RejectData) and rejected is not None:
                    body += event.data
                    if len(body) > max_refusal:
                        raise WebSocketRejected(rejected.status_code, list(rejected.headers),
                                                bytes(body[:max_refusal]), truncated=True)
                    if event.body_finished:
                        raise WebSocketRejected(rejected.status_code, list(rejected.headers), bytes(body))
            if not data:
                if rejected is not None:
                    raise WebSocketRejected(rejected.status_code, list(rejected.headers), bytes(body))
                raise ConnectionError("the server closed the connection during the websocket handshake")

    async def send(self, message: str | bytes) -> None:
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        async with self._write_lock:
            await self._stream.write(self._ws.send(event))

    async def receive(self) -> str | bytes | None:
        """The next whole message; None once the connection is closed (``close_code`` says how)."""
        while True:
            while self._pending:
                event = self._pending.pop(0)
                message = await self._handle(event)
                if message is not None:
                    return message
            if self._closed:
                return None
            data = await self._stream.read()
            if not data:
                self._closed = True
                if self.close_code is None:
                    self.close_code = 1006
                return None
            self._ws.receive_data(data)
            self._pending.extend(self._ws.events())

    async def _handle(self, event: Event) -> str | bytes | None:
        if isinstance(event, TextMessage | BytesMessage):
            self._parts.append(event.data if isinstance(event.data, str) else bytes(event.data))
            self._size += len(event.data)
            if self._size > MAX_MESSAGE:
                await self.close(1009, "message too big")
                return None
            if not event.message_finished:
                return None
            parts, self._parts, self._size = self._parts, [], 0
            if isinstance(event, TextMessage):
                return "".join(str(p) for p in parts)
            return b"".join(p for p in parts if isinstance(p, bytes))
        if isinstance(event, Ping):
            async with self._write_lock:
                with contextlib.suppress(OSError, ConnectionError):
                    await self._stream.write(self._ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            self.close_code, self.close_reason = event.code, event.reason or ""
            if not self._closed:
                self._closed = True
                with contextlib.suppress(Exception):
                    async with self._write_lock:
                        await self._stream.write(self._ws.send(event.response()))
        return None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (once) and drop the stream."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                async with self._write_lock:
                    await self._stream.write(self._ws.send(CloseConnection(code=code, reason=reason)))
        await self._stream.aclose()


async def upgrade(stream: ByteStream, host: str, target: str, *, headers: Sequence[tuple[str, str]],
                  refused: Callable[[WebSocketRejected], BaseException]) -> WebSocketClient:
    """:meth:`WebSocketClient.connect`, closing ``stream`` if it fails; a refusal raises ``refused(exc)``."""
    try:
        return await WebSocketClient.connect(stream, host, target, headers=headers)
    except WebSocketRejected as exc:
        await stream.aclose()
        raise refused(exc) from None
    except BaseException:
        await stream.aclose()
        raise


async def receive_first_json(ws: WebSocketClient, *, bad: str, code: str) -> tuple[str | bytes | None, Any]:
    """The server's first message and its JSON (None when it is not text). One that cannot be read or parsed
    closes ``ws`` and raises CapsaError(``"<bad>: <why>"``, ``code``, 502); so does any failure, re-raised."""
    try:
        first = await ws.receive()
        return first, json.loads(first) if isinstance(first, str) else None
    except (ValueError, ConnectionError, OSError) as exc:
        await ws.close()
        raise CapsaError(f"{bad}: {exc}", code=code, status=502) from None
    except BaseException:
        await ws.close()
        raise

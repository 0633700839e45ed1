"""The SDK's HTTP transport: HTTP/1.1 with h11 straight on asyncio streams, behind ``httpx.AsyncClient``.

Hand-written because httpx's default transport (httpcore over anyio) spends about 1 ms per request on this
kind of host in its connection pool, its anyio stream wrappers, cancel scopes and trace hooks: measured on
one session through ``capsa serve`` (TCG, 2 cores), what a `true` costs on top of the guest channel was
3.88 ms with httpcore and 3.16 ms with this transport, a raw socket 1.6-1.7 ms; agents issue hundreds of
short commands per task. It keeps what the SDK needs from a transport and no more:

* kept-alive connections per origin (at most :data:`MAX_IDLE_PER_ORIGIN` idle, each reused only within
  :data:`KEEPALIVE_EXPIRY` seconds of its last response, below uvicorn's 5 s keep-alive, and never once
  the server has closed or sent anything unasked);
* at most ``max_connections`` requests in flight (waiting for a slot is httpx's ``pool`` timeout);
* ``http`` and ``https`` (the SDK's TLS context), TCP_NODELAY;
* httpx's ``connect``/``read``/``write``/``pool`` timeouts and exception types;
* request bodies streamed as httpx hands them over (the head goes out with the first piece), response
  bodies streamed to the reader; a response closed before its end closes its connection.

Proxies from the environment keep working: httpx mounts its own proxy transports for them and uses this
one only for requests that go direct. No HTTP/2, no Unix sockets (the SDK uses neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx

__all__ = ["KEEPALIVE_EXPIRY", "MAX_IDLE_PER_ORIGIN", "H11Transport"]

KEEPALIVE_EXPIRY = 4.0
"""Seconds an idle connection may be reused after its last response (uvicorn closes them after 5)."""
MAX_IDLE_PER_ORIGIN = 20
_READ = 64 * 1024
_HUNG_UP = "Server disconnected without sending a response."  # httpcore's words, which callers may match

_Origin = tuple[str, str, int]


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = 0.0

    def reusable(self, now: float) -> bool:
        # EOF on an idle connection: the server closed it (an unasked answer fails in h11 instead).
        return (now - self.idle_since < KEEPALIVE_EXPIRY and not self.reader.at_eof()
                and not self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


def _timeouts(request: httpx.Request) -> dict[str, float | None]:
    got = request.extensions.get("timeout", {})
    return {k: got.get(k) for k in ("connect", "read", "write", "pool")}


class H11Transport(httpx.AsyncBaseTransport):
    def __init__(self, *, ssl_context: ssl.SSLContext | None = None, max_connections: int = 100) -> None:
        self._ssl = ssl_context
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[_Origin, deque[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        scheme = request.url.scheme
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme!r}", request=request)
        timeouts = _timeouts(request)
        try:
            async with asyncio.timeout(timeouts["pool"]):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection slot became free in time", request=request) from None
        conn: _Connection | None = None
        try:
            origin = (scheme, request.url.host, request.url.port or (443 if scheme == "https" else 80))
            conn = self._take(origin) or await self._connect(origin, timeouts["connect"], request)
            await self._send(conn, request, timeouts["write"])
            response = await self._response_head(conn, request, timeouts["read"])
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise
        stream = _Body(self, origin, conn, request, timeouts["read"])
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason})

    def _take(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have expired
            if conn.reusable(now):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin, timeout: float | None,  # noqa: ASYNC109 - httpx's timeout
                       request: httpx.Request) -> _Connection:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl if self._ssl is not None else ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls, limit=_READ,
                                                               server_hostname=host if tls else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def _send(self, conn: _Connection, request: httpx.Request,
                    timeout: float | None) -> None:  # noqa: ASYNC109
        h = conn.h11
        target = request.url.raw_path
        head = h.send(h11.Request(method=request.method, target=target, headers=request.headers.raw))
        pending = head or b""
        try:
            assert isinstance(request.stream, httpx.AsyncByteStream)
            async for piece in request.stream:
                if piece:
                    pending += h.send(h11.Data(data=piece)) or b""
                    await self._write(conn, pending, timeout, request)
                    pending = b""
            pending += h.send(h11.EndOfMessage()) or b""
            await self._write(conn, pending, timeout, request)
        except h11.LocalProtocolError as exc:
            raise httpx.LocalProtocolError(str(exc), request=request) from exc

    @staticmethod
    async def _write(conn: _Connection, data: bytes, timeout: float | None,  # noqa: ASYNC109
                     request: httpx.Request) -> None:
        try:
            conn.writer.write(data)
            async with asyncio.timeout(timeout):
                await conn.writer.drain()
        except TimeoutError:
            raise httpx.WriteTimeout("writing the request timed out", request=request) from None
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__, request=request) from exc

    async def _response_head(self, conn: _Connection, request: httpx.Request,
                             timeout: float | None) -> h11.Response:  # noqa: ASYNC109
        while True:
            event = await _next_event(conn, request, timeout)
            if isinstance(event, h11.Response):
                return event
            if isinstance(event, h11.InformationalResponse):
                continue
            raise httpx.RemoteProtocolError(f"unexpected {type(event).__name__} before the response",
                                            request=request)

    def _release(self, origin: _Origin, conn: _Connection, reusable: bool) -> None:
        self._slots.release()
        idle = self._idle.setdefault(origin, deque())
        if reusable and not self._closed and len(idle) < MAX_IDLE_PER_ORIGIN:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                conn = idle.pop()
                conn.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await conn.writer.wait_closed()
        self._idle.clear()


async def _next_event(conn: _Connection, request: httpx.Request, timeout: float | None  # noqa: ASYNC109
                      ) -> Any:
    h = conn.h11
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        if event is not h11.NEED_DATA:
            if isinstance(event, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError(_HUNG_UP, request=request)
            return event
        try:
            async with asyncio.timeout(timeout):
                data = await conn.reader.read(_READ)
        except TimeoutError:
            raise httpx.ReadTimeout("reading the response timed out", request=request) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        if not data and h.their_state is h11.SEND_RESPONSE:
            raise httpx.RemoteProtocolError(_HUNG_UP, request=request)
        try:
            h.receive_data(data)  # b"" is the end of the stream
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc


class _Body(httpx.AsyncByteStream):
    """A response's body; its end hands the connection back (reused if both sides may go on)."""

    def __init__(self, transport: H11Transport, origin: _Origin, conn: _Connection, request: httpx.Request,
                 timeout: float | None) -> None:
        self._transport, self._origin, self._request, self._timeout = transport, origin, request, timeout
        self._conn: _Connection | None = conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        try:
            while True:
                event = await _next_event(conn, self._request, self._timeout)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
        except BaseException:
            self._finish(reusable=False)
            raise
        h = conn.h11
        reusable = h.our_state is h11.DONE and h.their_state is h11.DONE
        if reusable:
            h.start_next_cycle()
        self._finish(reusable)

    def _finish(self, reusable: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._transport._release(self._origin, conn, reusable)

    async def aclose(self) -> None:
        self._finish(reusable=False)  # closed before its end (or already handed back: nothing to do)

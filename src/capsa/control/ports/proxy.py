"""The port proxy: HTTP requests and WebSocket sessions relayed to a port inside a sandbox.

Every request gets its own port tunnel (:meth:`NodeClient.open_port`, a raw TCP connection to
``127.0.0.1:<port>`` in the guest over the guest channel). HTTP is spoken with h11 over it, one request
per connection (``Connection: close``): the request body is streamed to the port while the response is
streamed back, so uploads and downloads of any size flow through bounded buffers (credit windows all the
way to the guest). A WebSocket from the client is answered by a WebSocket client (wsproto) to the port
over the tunnel; messages are relayed both ways and the close code is passed on.

What the app in the sandbox sees: the path after ``/ports/{port}`` (or the whole path on the port's own
host, :mod:`capsa.control.ports.hosts`), the query without ``token``, the client's headers less hop-by-hop
ones, the API key and the port token (also out of a ``Referer``), ``Host: localhost:<port>``, and
``X-Forwarded-For``/``-Host``/``-Proto`` (and ``-Prefix`` on the path route) naming who reached it and
where. What the client sees of the app's answer: :mod:`capsa.control.ports.headers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import h11
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from capsa.common import ws_relay
from capsa.common.port_tunnel import PortTunnel
from capsa.common.websocket import WebSocketClient, WebSocketRejected
from capsa.control.errors import ApiError
from capsa.control.ports.access import TOKEN_COOKIE, TOKEN_HEADER, TOKEN_QUERY, PortAccess, port_path
from capsa.control.ports.headers import response_headers
from capsa.control.store.models import utcnow

__all__ = ["proxy_http", "proxy_websocket", "relay_tunnel"]

log = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_WS_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                           "sec-websocket-protocol", "sec-websocket-accept"})
MAX_HEAD = 256 * 1024
"""The largest response head (status line + headers) accepted from the app."""


class PortProtocolError(ApiError):
    code, status, title = "port_protocol_error", 502, "Bad answer from the port"


def _target(conn: HTTPConnection, path: str) -> str:
    query = [(k, v) for k, v in conn.query_params.multi_items() if k != TOKEN_QUERY]
    target = "/" + path.lstrip("/")
    return target + ("?" + urlencode(query) if query else "")


def _forward_headers(conn: HTTPConnection, access: PortAccess, port: int, *,
                     drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name, value in conn.headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in drop or lower == TOKEN_HEADER:
            continue
        if lower == "authorization" and access.used_api_key:
            continue
        if lower == "cookie":
            value = _without_token_cookie(value)
            if not value:
                continue
        elif lower == "referer":
            value = _without_token_query(value)
        out.append((lower, value))
    out += [("x-forwarded-for", conn.client.host if conn.client else ""),
            ("x-forwarded-host", conn.headers.get("host", "")),
            ("x-forwarded-proto", "https" if conn.url.scheme in ("https", "wss") else "http")]
    if not access.on_host:
        out.append(("x-forwarded-prefix", port_path(access.target.id, port).rstrip("/")))
    return out


def _without_token_query(url: str) -> str:
    """``url`` (a Referer) without its ``token`` query parameter."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ""
    if TOKEN_QUERY not in parts.query:
        return url
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != TOKEN_QUERY]
    return urlunsplit(parts._replace(query=urlencode(query)))


_RESPONSE_DROP = _HOP_BY_HOP - {"content-length"}


class _RelayedResponse(Response):
    """The app's response, streamed. Unlike StreamingResponse it never reads the request: the upload task
    owns ``receive`` (and learns of a client that went away from it)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks: AsyncIterator[bytes]) -> None:
        super().__init__(status_code=status)
        self.raw_headers = headers
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _without_token_cookie(header: str) -> str:
    kept = [part.strip() for part in header.split(";")
            if part.strip() and part.split("=", 1)[0].strip() != TOKEN_COOKIE]
    return "; ".join(kept)


def _token_cookie(conn: HTTPConnection, access: PortAccess, port: int) -> tuple[bytes, bytes] | None:
    """The token that came in the URL as a cookie: for the port's own host (no ``Domain``: that host
    only), or for the port's path on the API's origin; it lasts as long as the token."""
    if access.query_token is None:
        return None
    secure = "; Secure" if conn.url.scheme == "https" else ""
    path = "/" if access.on_host else port_path(access.target.id, port)
    max_age = _seconds_left(access.token_expires_at)
    value = (f"{TOKEN_COOKIE}={access.query_token}; Path={path}; Max-Age={max_age}; HttpOnly; "
             f"SameSite=Lax{secure}")
    return b"set-cookie", value.encode("latin-1")


def _seconds_left(expires_at: datetime | None) -> int:
    return 0 if expires_at is None else max(0, int((expires_at - utcnow()).total_seconds()))


async def _events(conn: h11.Connection, tunnel: PortTunnel) -> AsyncIterator[h11.Event]:
    """The app's answer as h11 events (the tunnel's EOF ends a read-until-close body)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await tunnel.read())
            continue
        if event is h11.PAUSED:
            return
        assert isinstance(event, h11.Event)
        yield event
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return


async def proxy_http(request: Request, access: PortAccess, port: int, path: str,
                     tunnel: PortTunnel) -> Response:
    """Send ``request`` to the port over ``tunnel`` and answer with the app's response, streamed."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    headers = _forward_headers(request, access, port)
    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if length is not None and not chunked:
        headers.append(("content-length", length))
    elif chunked:
        headers.append(("transfer-encoding", "chunked"))
    headers += [("host", f"localhost:{port}"), ("connection", "close")]
    try:
        await tunnel.write(conn.send(h11.Request(method=request.method, target=_target(request, path),
                                                 headers=headers)))
    except (h11.LocalProtocolError, ValueError) as exc:
        await tunnel.aclose()
        raise ApiError(f"cannot forward this request: {exc}", code="bad_request", status=400) from None
    except BaseException:
        await tunnel.aclose()
        raise

    async def send_body() -> None:
        try:
            async for chunk in request.stream():
                if chunk:
                    await tunnel.write(conn.send(h11.Data(data=chunk)))
            await tunnel.write(conn.send(h11.EndOfMessage()))
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except ClientDisconnect:
            pass
        except h11.LocalProtocolError as exc:  # a body longer or shorter than its Content-Length
            log.info("request body for port %s cut: %s", port, exc)
        # The client went away (or sent a bad body): drop the connection to the app.
        await tunnel.aclose()

    upload = asyncio.create_task(send_body())
    events = _events(conn, tunnel)
    try:
        while True:
            event = await anext(events, None)
            if event is None or isinstance(event, h11.ConnectionClosed):
                raise PortProtocolError(f"port {port} closed the connection without an HTTP response")
            if isinstance(event, h11.Response):
                break
            # InformationalResponse (100 Continue ...): the final answer follows.
    except h11.RemoteProtocolError as exc:
        await _stop(upload, tunnel)
        raise PortProtocolError(f"port {port} does not answer HTTP: {exc}") from None
    except (ConnectionError, OSError) as exc:
        await _stop(upload, tunnel)
        raise PortProtocolError(f"the connection to port {port} broke: {exc}") from None
    except BaseException:
        await _stop(upload, tunnel)
        raise
    relayed = response_headers(
        [(k.lower(), v) for k, v in event.headers if k.decode("latin-1").lower() not in _RESPONSE_DROP],
        None if access.on_host else port_path(access.target.id, port))
    cookie = _token_cookie(request, access, port)
    if cookie is not None:
        relayed.append(cookie)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for item in events:
                if isinstance(item, h11.Data):
                    yield bytes(item.data)
        except (h11.RemoteProtocolError, ConnectionError, OSError) as exc:
            # The status line is out: aborting the response is the only way left to say "incomplete".
            log.info("response from port %s broke midway: %s", port, exc)
            raise
        finally:
            await _stop(upload, tunnel)

    return _RelayedResponse(event.status_code, relayed, body())


async def _stop(upload: asyncio.Task[None], tunnel: PortTunnel) -> None:
    if not upload.done():
        upload.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await upload
    await tunnel.aclose()


async def proxy_websocket(websocket: WebSocket, access: PortAccess, port: int, path: str,
                          tunnel: PortTunnel, *, rewrite: Callable[[str], str] | None = None) -> None:
    """Relay a client WebSocket (not yet accepted) to a WebSocket server on the port; ``rewrite`` (if
    given) maps each of the client's text messages before it is sent on."""
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    headers = _forward_headers(websocket, access, port, drop=_WS_HANDSHAKE)
    try:
        upstream = await WebSocketClient.connect(tunnel, f"localhost:{port}", _target(websocket, path),
                                                 headers=headers, subprotocols=offered)
    except WebSocketRejected as exc:
        await tunnel.aclose()
        await websocket.close(code=1008, reason=f"the app refused the upgrade with HTTP {exc.status}"[:120])
        return
    except (ConnectionError, OSError) as exc:
        await tunnel.aclose()
        await websocket.close(code=1011, reason=f"port {port}: {exc}"[:120])
        return
    await websocket.accept(subprotocol=upstream.subprotocol)

    async def client_to_app() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(int(message.get("code") or 1000))
                return
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(rewrite(message["text"]) if rewrite else message["text"])

    async def app_to_client() -> None:
        while True:
            message = await upstream.receive()
            if message is None:
                code = upstream.close_code or 1000
                with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                    await websocket.close(code=1000 if code in (1005, 1006) else code,
                                          reason=upstream.close_reason[:120])
                return
            if isinstance(message, bytes):
                await websocket.send_bytes(message)
            else:
                await websocket.send_text(message)

    await _both(client_to_app(), app_to_client())
    await upstream.close()


async def relay_tunnel(websocket: WebSocket, tunnel: PortTunnel) -> None:
    """The public raw tunnel (already accepted, status sent): client BINARY <-> the node's tunnel. The port
    closing its side closes 1000; a failure of either side ends the tunnel without a close frame (the
    connection drops, as the TCP connection it stands for would)."""

    async def to_port(data: bytes) -> None:
        if data:
            await tunnel.write(data)
        else:
            await tunnel.end()

    async def from_port() -> AsyncIterator[bytes]:
        while data := await tunnel.read():
            yield data

    await ws_relay.relay(websocket, from_port(), on_bytes=to_port, close_on_failure=False,
                         quiet=(BaseException,), what="port tunnel")
    await tunnel.aclose()


async def _both(a: Coroutine[Any, Any, None], b: Coroutine[Any, Any, None]) -> None:
    """Run two relay directions until either ends (or fails); cancel the other."""
    tasks = [asyncio.ensure_future(a), asyncio.ensure_future(b)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

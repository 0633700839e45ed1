"""The Connect RPC wire format (JSON codec) that E2B's in-sandbox daemon (envd) speaks.

Unary calls: ``POST /<service>/<Method>`` with ``Content-Type: application/json``, the request message as
JSON; the answer is the response message as JSON (200) or an error ``{"code": "not_found", "message": …}``
with the HTTP status of that code. Server streams: ``Content-Type: application/connect+json``; the request
and every response message travel in envelopes (1 flag byte + 4-byte big-endian length + JSON); the last
envelope has flag ``0x02`` and carries ``{}`` or ``{"error": {…}}``; the HTTP status is 200 once streaming
has begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from capsa.common.errors import CapsaError

__all__ = [
    "END_STREAM",
    "KEEPALIVE_S",
    "MAX_MESSAGE_BYTES",
    "STREAM_MEDIA_TYPE",
    "ConnectError",
    "as_connect",
    "connect_code_for",
    "envelope",
    "error_response",
    "paced",
    "read_message",
    "read_messages",
    "single_message_stream",
    "stream_response",
    "unary_response",
]

STREAM_MEDIA_TYPE = "application/connect+json"
KEEPALIVE_S = 50.0
"""Idle seconds between keepalive messages on a stream (the SDK announces a 50 s ping interval)."""
END_STREAM = 0x02
_COMPRESSED = 0x01
MAX_MESSAGE_BYTES = 4 << 20
"""Largest request message (its JSON) a call may send."""

_HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

# capsa error codes (control plane, node, guest) -> Connect codes; anything else goes by HTTP status.
_FROM_CAPSA = {
    "not_found": "not_found", "sandbox_not_found": "not_found", "no_such_process": "not_found",
    "unauthorized": "unauthenticated", "forbidden": "permission_denied",
    "permission_denied": "permission_denied", "bad_request": "invalid_argument",
    "validation_error": "invalid_argument", "is_a_directory": "invalid_argument",
    "not_a_directory": "invalid_argument", "not_executable": "invalid_argument",
    "already_exists": "already_exists", "directory_not_empty": "failed_precondition",
    "no_space": "resource_exhausted", "rate_limited": "resource_exhausted",
    "quota_exceeded": "resource_exhausted", "too_large": "resource_exhausted",
    "payload_too_large": "resource_exhausted", "guest_timeout": "deadline_exceeded",
    "node_unreachable": "unavailable", "guest_unavailable": "unavailable",
    "invalid_state": "failed_precondition", "session_failed": "failed_precondition",
    "process_exited": "failed_precondition", "stdin_closed": "failed_precondition",
    "unsupported": "unimplemented",
}
_BY_STATUS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
              409: "already_exists", 413: "resource_exhausted", 429: "resource_exhausted",
              501: "unimplemented", 503: "unavailable", 504: "deadline_exceeded"}


class ConnectError(Exception):
    """An error to answer in Connect form: ``code`` is one of Connect's codes (``not_found`` …)."""

    def __init__(self, code: str, message: str) -> None:
        assert code in _HTTP_STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self.code]

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def connect_code_for(exc: CapsaError) -> str:
    """The Connect code for a capsa error (its stable ``code`` first, else its HTTP status)."""
    return _FROM_CAPSA.get(exc.code) or _BY_STATUS.get(exc.status) or (
        "internal" if exc.status >= 500 else "unknown")


def as_connect(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, CapsaError):
        return ConnectError(connect_code_for(exc), exc.message)
    return ConnectError("internal", type(exc).__name__)


def envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", "the request message is not valid JSON") from exc
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request message must be a JSON object")
    return message


async def read_message(request: Request) -> dict[str, Any]:
    """The one request message of a unary or server-streaming call, as a JSON object."""
    content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise ConnectError("unimplemented", "compressed requests are not supported")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE_BYTES + 5:
            raise ConnectError("resource_exhausted", "request message too large")
    if content_type == STREAM_MEDIA_TYPE:
        if len(body) < 5:
            raise ConnectError("invalid_argument", "missing request envelope")
        flags, length = struct.unpack(">BI", body[:5])
        if flags & _COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not supported")
        if len(body) < 5 + length:
            raise ConnectError("invalid_argument", "truncated request envelope")
        return _parse_json(body[5:5 + length])
    if content_type == "application/json":
        return _parse_json(body)
    raise ConnectError("unimplemented", f"unsupported content type {content_type!r} (only the JSON codec)")


async def read_messages(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a client stream (``application/connect+json``) as they arrive, until the client
    ends its request body (or sends an end-of-stream envelope)."""
    content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if content_type != STREAM_MEDIA_TYPE:
        raise ConnectError("unimplemented", f"unsupported content type {content_type!r} for a client stream")
    buffer = b""
    async for chunk in request.stream():
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack(">BI", buffer[:5])
            if length > MAX_MESSAGE_BYTES:
                raise ConnectError("resource_exhausted", "request message too large")
            if len(buffer) < 5 + length:
                break
            data, buffer = buffer[5:5 + length], buffer[5 + length:]
            if flags & _COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported")
            if flags & END_STREAM:
                return
            yield _parse_json(data)
    if buffer:
        raise ConnectError("invalid_argument", "truncated request envelope")


def single_message_stream(message: Mapping[str, Any]) -> Response:
    """The answer of a client stream: one enveloped message, then the end of the stream."""
    return Response(envelope(message) + envelope({}, END_STREAM), media_type=STREAM_MEDIA_TYPE)


def unary_response(message: Mapping[str, Any]) -> JSONResponse:
    return JSONResponse(dict(message))


def error_response(exc: ConnectError, streaming: bool) -> Response:
    """An error answered before any message was sent; streams use an end-of-stream envelope on 200."""
    if streaming:
        return Response(envelope({"error": exc.body()}, END_STREAM), media_type=STREAM_MEDIA_TYPE)
    return JSONResponse(exc.body(), status_code=exc.http_status)


async def _framed(messages: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    trailer: dict[str, Any] = {}
    try:
        async for message in messages:
            yield envelope(message)
    except Exception as exc:
        trailer = {"error": as_connect(exc).body()}
    yield envelope(trailer, END_STREAM)


def stream_response(messages: AsyncIterator[Mapping[str, Any]]) -> StreamingResponse:
    """A server stream: each message enveloped, then the end-of-stream envelope (an error raised by
    ``messages`` becomes its ``error``)."""
    return StreamingResponse(_framed(messages), media_type=STREAM_MEDIA_TYPE)


_DONE = object()


async def paced(source: AsyncIterator[Mapping[str, Any]], keepalive: Mapping[str, Any], *,
                deadline: float | None = None, on_deadline: Callable[[], Awaitable[None]] | None = None,
                deadline_message: str = "deadline exceeded") -> AsyncIterator[Mapping[str, Any]]:
    """``source``'s messages, with ``keepalive`` while it is idle for :data:`KEEPALIVE_S`, and
    ``deadline_exceeded`` at ``deadline`` (``time.monotonic()``; after ``on_deadline()``). ``source`` runs
    in a task of its own, so waiting never cancels it mid-step; leaving closes it."""
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(_DONE)
        except Exception as exc:
            await queue.put(exc)

    task = asyncio.create_task(pump())
    try:
        while True:
            wait = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, deadline - time.monotonic())
            try:
                item = await asyncio.wait_for(queue.get(), timeout=max(wait, 0.0))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    if on_deadline is not None:
                        await on_deadline()
                    raise ConnectError("deadline_exceeded", deadline_message) from None
                yield keepalive
                continue
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

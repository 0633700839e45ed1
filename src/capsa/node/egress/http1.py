"""The HTTP/1.1 pieces the broker's parts share: the sandbox side of a connection (spoken with h11), the
request under way, a refusal (:class:`Deny`) and how it is answered, and the deadlines of reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import h11

from capsa.common.egress_policy import DomainRule

__all__ = [
    "HOP_BY_HOP",
    "STREAM_LIMIT",
    "Client",
    "Deny",
    "Request",
    "guarded",
    "header",
    "next_event",
    "printable",
    "send_deny",
    "send_plain_error",
    "until",
    "where",
]

HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
    b"te", b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"http2-settings",
}
_log = logging.getLogger(__name__)

STREAM_LIMIT = 64 * 1024
"""The most one read of a connection takes (and the StreamReaders' limit)."""


def until(deadline: float) -> Callable[[], float]:
    """Seconds left before ``deadline`` (monotonic), as the read timeouts of one whole phase."""
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        return remaining
    return left


def where(exc: BaseException) -> str:
    """Where an exception was raised (file:line), for a log line that must not quote its message: h11's and
    ssl's messages can hold header values, and header values can hold secrets."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


async def guarded(sandbox_id: str, run: Callable[[], Awaitable[None]], close: Callable[[], None]) -> None:
    """Run one connection of the sandbox, then ``close`` it: a connection that breaks or times out just ends;
    anything else is logged (by where it was raised, see :func:`where`)."""
    try:
        await run()
    except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError, h11.ProtocolError):
        pass
    except asyncio.CancelledError:
        pass
    except Exception as exc:
        # Not the message: it can quote header values (see where).
        _log.error("egress connection of %s failed: %s at %s", sandbox_id, exc.__class__.__name__, where(exc))
    finally:
        close()


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k == name]


def printable(value: bytes, limit: int = 100) -> str:
    """A header value as it may appear in an audit reason: ASCII, printable, bounded."""
    text = value.decode("latin-1")[:limit]
    return "".join(c if " " <= c <= "~" else "?" for c in text)


class Deny(Exception):
    """A request the broker refuses: answered with ``status`` and audited with ``reason``; ``body`` (when
    given) is answered as JSON instead of the plain-text reason."""

    def __init__(self, status: int, reason: str, *, rule: str | None = None, close: bool = True,
                 body: dict[str, Any] | None = None, detail: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.rule, self.close = status, reason, rule, close
        self.body, self.detail = body, detail


@dataclass
class Request:
    """One request of the sandbox as the broker handles it (the head after checks and injection)."""

    method: str
    target: str
    path: str
    host: str
    port: int
    headers: list[tuple[bytes, bytes]]
    rule: DomainRule | None = None
    secret_ids: list[str] = field(default_factory=list)
    bytes_out: int = 0
    approval_id: str | None = None
    """The approval that let the request through (None: none was needed)."""


async def next_event(conn: h11.Connection, reader: asyncio.StreamReader, left: Callable[[], float]
                     ) -> h11.Event | type[h11.PAUSED]:
    """The next event of ``conn``, reading ``reader`` as it needs; each read waits at most ``left()``
    seconds (which raises once time is up)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(STREAM_LIMIT), left())
            conn.receive_data(data)
            continue
        return event  # type: ignore[return-value]


class Client:
    """The sandbox side of one connection, spoken with h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=32 * 1024)

    async def next_event(self, left: Callable[[], float]) -> h11.Event | type[h11.PAUSED]:
        """The next event; each read waits at most ``left()`` seconds (which raises once time is up)."""
        return await next_event(self.conn, self.reader, left)

    async def send(self, *events: h11.Event, left: Callable[[], float] | None = None) -> None:
        # One write per response: fewer segments and TLS records.
        self.writer.write(b"".join(self.conn.send(ev) or b"" for ev in events))
        await asyncio.wait_for(self.writer.drain(), left() if left is not None else None)


async def send_deny(client: Client, deny: Deny, wait_s: float) -> None:
    """Answer a refused request (when the connection can still take an answer)."""
    if deny.body is not None:
        body = json.dumps(deny.body).encode() + b"\n"
        kind = b"application/json"
    else:
        body = f"capsa egress: {deny.reason}\n".encode()
        kind = b"text/plain"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
               (b"x-capsa-egress", b"denied")]
    if deny.close or client.conn.their_state is not h11.DONE:
        headers.append((b"connection", b"close"))
    try:
        if client.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await client.send(h11.Response(status_code=deny.status, headers=headers),
                              h11.Data(data=body), h11.EndOfMessage(), left=until(time.monotonic() + wait_s))
    except (h11.LocalProtocolError, ConnectionError, TimeoutError):
        pass


async def send_plain_error(writer: asyncio.StreamWriter, status: int, text: str, wait_s: float) -> None:
    """Answer a request h11 could not parse (so h11 cannot frame the answer either)."""
    body = f"capsa egress: {text}\n".encode()
    writer.write(f"HTTP/1.1 {status} Refused\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}"
                 f"\r\nconnection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(ConnectionError, TimeoutError):
        await asyncio.wait_for(writer.drain(), wait_s)

"""A plain-HTTP/1.1 server for loopback tests (the upstream behind the egress broker): h11 parses each
request, ``answer`` turns the request and its whole body into a response, keep-alive is kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import h11

__all__ = ["Answer", "h11_handler"]

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""Status, headers (``content-length`` is added) and body."""

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


def h11_handler(answer: Callable[[h11.Request, bytes], Answer]) -> Handler:
    """An ``asyncio.start_server`` callback answering every request with ``answer(request, body)``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = b""
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(ev, h11.Request):
                    request, body = ev, b""
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    assert request is not None
                    status, headers, payload = answer(request, body)
                    head = h11.Response(status_code=status, headers=[
                        *headers, (b"content-length", str(len(payload)).encode())])
                    writer.write((conn.send(head) or b"") + (conn.send(h11.Data(data=payload)) or b"")
                                 + (conn.send(h11.EndOfMessage()) or b""))
                    await writer.drain()
                    conn.start_next_cycle()
                else:
                    return
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()

    return handle

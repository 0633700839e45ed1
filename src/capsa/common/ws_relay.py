"""One WebSocket byte relay: a client's accepted WebSocket on one side, a byte stream (a port tunnel, a
terminal) on the other, used by the node's and the control plane's port tunnels and terminals alike.

Two directions run until either ends. Client to far side: each BINARY message goes to ``on_bytes`` (an
empty one too: the port tunnels read it as a half-close), each TEXT message to ``on_text`` (ignored when
None); the client leaving ends the relay without a close frame (it is gone). Far side to client: each item
of ``downstream`` is sent on, ``bytes`` as BINARY and ``str`` as TEXT; when it is exhausted the WebSocket is
closed with 1000. A failure of either direction closes with 1011 after the text ``failure_text`` gives for
it (when not None), unless ``close_on_failure`` is false (then the connection is just left to drop). A
failure whose type is not in ``quiet`` is logged as a warning naming ``what``. Whatever ends the relay, both
directions are cancelled and awaited before it returns; closing the far side is the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, Awaitable, Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

__all__ = ["QUIET_FAILURES", "relay"]

log = logging.getLogger(__name__)

QUIET_FAILURES: tuple[type[BaseException], ...] = (WebSocketDisconnect, OSError)
"""Failures that are a side going away rather than a fault: never logged."""


async def relay(websocket: WebSocket, downstream: AsyncIterable[bytes | str], *,
                on_bytes: Callable[[bytes], Awaitable[None]],
                on_text: Callable[[str], Awaitable[None]] | None = None,
                failure_text: Callable[[BaseException], str | None] | None = None,
                close_on_failure: bool = True,
                quiet: tuple[type[BaseException], ...] = QUIET_FAILURES,
                what: str = "WebSocket relay") -> None:
    """Relay between ``websocket`` (accepted) and a far side until either ends (see the module doc)."""

    async def from_client() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is not None:
                await on_bytes(data)
                continue
            text = message.get("text")
            if text is not None and on_text is not None:
                await on_text(text)

    async def to_client() -> None:
        async for item in downstream:
            if isinstance(item, bytes):
                await websocket.send_bytes(item)
            else:
                await websocket.send_text(item)

    up = asyncio.create_task(from_client())
    down = asyncio.create_task(to_client())
    try:
        done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        finished = down if down in done else up
        exc = finished.exception()
        if finished is up and exc is None:
            return  # the client left
        if exc is not None and not isinstance(exc, quiet):
            log.warning("%s failed: %r", what, exc)
        if exc is not None and not close_on_failure:
            return
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            text = failure_text(exc) if exc is not None and failure_text is not None else None
            if text is not None:
                await websocket.send_text(text)
            await websocket.close(code=1000 if exc is None else 1011)
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

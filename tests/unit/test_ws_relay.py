"""The one WebSocket byte relay (:mod:`capsa.common.ws_relay`) on an in-memory ASGI WebSocket: both
directions, the far side ending (close 1000), the client leaving (no close frame), a failure on either side
(close 1011 after the failure text, or no close at all), and which failures are logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.websockets import WebSocket

from capsa.common import ws_relay

_END = object()


class Client:
    """The client's side of an accepted in-memory WebSocket: what it sends, and what it was sent."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.inbox.put_nowait({"type": "websocket.connect"})
        scope = {"type": "websocket", "path": "/", "headers": [], "query_string": b""}
        self.websocket = WebSocket(scope, self.inbox.get, self._send)

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def says(self, data: bytes | str) -> None:
        key = "bytes" if isinstance(data, bytes) else "text"
        self.inbox.put_nowait({"type": "websocket.receive", key: data})

    def leaves(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1001})

    def got(self) -> list[Any]:
        """What was sent after the accept: data as is, a close as ("close", code)."""
        out: list[Any] = []
        for m in self.sent[1:]:
            if m["type"] == "websocket.close":
                out.append(("close", m["code"]))
            else:
                out.append(m.get("bytes") if m.get("bytes") is not None else m.get("text"))
        return out


class FarSide:
    """A byte stream the test feeds: items to send on, ``_END`` to end, an exception to fail."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.received: list[bytes | str] = []
        self.cancelled = False

    async def output(self) -> AsyncIterator[bytes | str]:
        try:
            while (item := await self.items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def on_bytes(self, data: bytes) -> None:
        if data == b"boom":
            raise RuntimeError("write failed")
        self.received.append(data)

    async def on_text(self, text: str) -> None:
        self.received.append(text)


async def _start(**options: Any) -> tuple[Client, FarSide, asyncio.Task[None]]:
    client, far = Client(), FarSide()
    await client.websocket.accept()
    task = asyncio.create_task(ws_relay.relay(client.websocket, far.output(), on_bytes=far.on_bytes,
                                              on_text=far.on_text, **options))
    return client, far, task


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_bytes_and_text_flow_both_ways_and_the_far_side_ending_closes_1000() -> None:
    client, far, task = await _start()
    client.says(b"in")
    client.says(b"")  # an empty BINARY message reaches on_bytes too (the tunnels' half-close)
    client.says("resize")
    far.items.put_nowait(b"out")
    far.items.put_nowait("exit")
    await _settle()
    assert far.received == [b"in", b"", "resize"]
    far.items.put_nowait(_END)
    await asyncio.wait_for(task, 5)
    assert client.got() == [b"out", "exit", ("close", 1000)]


async def test_text_is_ignored_without_on_text() -> None:
    client, far = Client(), FarSide()
    await client.websocket.accept()
    task = asyncio.create_task(ws_relay.relay(client.websocket, far.output(), on_bytes=far.on_bytes))
    client.says("ignored")
    client.says(b"kept")
    await _settle()
    far.items.put_nowait(_END)
    await asyncio.wait_for(task, 5)
    assert far.received == [b"kept"]


async def test_the_client_leaving_ends_the_relay_without_a_close_and_stops_the_far_side() -> None:
    client, far, task = await _start()
    far.items.put_nowait(b"before")
    await _settle()
    client.leaves()
    await asyncio.wait_for(task, 5)
    assert client.got() == [b"before"] and far.cancelled


@pytest.mark.parametrize("side", ["far side", "client side"])
async def test_a_failure_closes_1011_after_its_text_and_is_logged(side: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    client, far, task = await _start(failure_text=lambda exc: f"error: {exc}", what="test relay")
    with caplog.at_level(logging.WARNING, logger=ws_relay.__name__):
        if side == "far side":
            far.items.put_nowait(RuntimeError("read failed"))
        else:
            client.says(b"boom")
        await asyncio.wait_for(task, 5)
    failed = "read failed" if side == "far side" else "write failed"
    assert client.got() == [f"error: {failed}", ("close", 1011)]
    assert [r.getMessage() for r in caplog.records] == [f"test relay failed: RuntimeError('{failed}')"]


async def test_quiet_failures_are_not_logged_and_no_text_means_a_bare_1011(
        caplog: pytest.LogCaptureFixture) -> None:
    client, far, task = await _start(failure_text=lambda exc: None)
    with caplog.at_level(logging.WARNING, logger=ws_relay.__name__):
        far.items.put_nowait(OSError("the far side went away"))
        await asyncio.wait_for(task, 5)
    assert client.got() == [("close", 1011)] and caplog.records == []


async def test_without_close_on_failure_a_failure_sends_nothing() -> None:
    client, far, task = await _start(close_on_failure=False, quiet=(BaseException,))
    far.items.put_nowait(b"some")
    far.items.put_nowait(RuntimeError("gone"))
    await asyncio.wait_for(task, 5)
    assert client.got() == [b"some"]

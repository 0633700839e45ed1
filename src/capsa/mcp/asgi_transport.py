"""An httpx transport into an ASGI app in the same process that streams the response body.

``httpx.ASGITransport`` runs the app to the end and keeps the whole body before answering, so a client
reading a large streamed response (a file) through it would make the server hold all of it in memory.
Here the app runs in a task of its own and hands each body chunk over a small queue: the client reads
while the app writes, the app waits while the client is behind, and closing the response early (the
client read enough) tells the app the client left and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import httpx
from starlette.types import ASGIApp, Message

__all__ = ["StreamingASGITransport"]

_QUEUE_CHUNKS = 4  # body chunks in flight between the app and the client
_END = object()


class _Body(httpx.AsyncByteStream):
    def __init__(self, queue: asyncio.Queue[Any], task: asyncio.Task[None], gone: asyncio.Event) -> None:
        self._queue, self._task, self._gone = queue, task, gone

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise httpx.ReadError(f"the application failed while sending the body: {item!r}") from item
            yield item

    async def aclose(self) -> None:
        self._gone.set()
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Send requests to ``app`` (an ASGI 3 application) without a network, streaming both bodies."""

    def __init__(self, app: ASGIApp, *, client: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self._app = app
        self._client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw], "scheme": url.scheme,
            "path": unquote(url.path), "raw_path": url.raw_path.split(b"?", 1)[0], "query_string": url.query,
            "server": (url.host, url.port or (443 if url.scheme == "https" else 80)), "client": self._client,
            "root_path": "",
        }
        upload = _request_chunks(request)
        uploaded = ended = False
        gone = asyncio.Event()
        queue: asyncio.Queue[Any] = asyncio.Queue(_QUEUE_CHUNKS)
        started = asyncio.get_running_loop().create_future()

        async def receive() -> Message:
            nonlocal uploaded
            if not uploaded:
                chunk = await anext(upload, None)
                if chunk is not None:
                    return {"type": "http.request", "body": chunk, "more_body": True}
                uploaded = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()  # until the client closes the response
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                if not started.done():
                    started.set_result((message["status"], message.get("headers", [])))
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body:
                    await queue.put(bytes(body))
                if not message.get("more_body", False) and not ended:
                    ended = True
                    await queue.put(_END)

        async def run() -> None:
            try:
                await self._app(scope, receive, send)
            except Exception as exc:
                if not started.done():
                    started.set_exception(exc)
                else:
                    await queue.put(exc)  # the reader sees it after the chunks before it
                return
            if not started.done():
                started.set_exception(RuntimeError("the application sent no response"))
            elif not ended:
                await queue.put(_END)

        task = asyncio.create_task(run(), name=f"asgi {request.method} {url.path}")
        try:
            status, headers = await asyncio.shield(started)
        except BaseException:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise
        return httpx.Response(status, headers=headers, stream=_Body(queue, task, gone), request=request)


async def _request_chunks(request: httpx.Request) -> AsyncIterator[bytes]:
    stream = request.stream
    if isinstance(stream, httpx.AsyncByteStream):
        async for chunk in stream:
            if chunk:
                yield chunk
    else:  # a body given as bytes is both kinds of stream; a sync-only one is not sent by AsyncClient
        yield request.read()

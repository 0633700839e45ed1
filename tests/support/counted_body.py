"""Request bodies that count how much of them the server pulled: an attack body for the request-size
tests, sent into an app through httpx's ASGI transport (which pulls a chunk only when the app reads one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from starlette.types import ASGIApp

__all__ = ["CHUNK", "CountedBody", "send_counted"]

CHUNK = 64 * 1024


class CountedBody:
    """``size`` bytes (``first``, then filler) in chunks of :data:`CHUNK`; ``pulled`` counts what was
    taken. ``gate``: wait on it before the first chunk (a body that stays in flight)."""

    def __init__(self, size: int, first: bytes = b"", gate: asyncio.Event | None = None) -> None:
        self.size = size
        self.first = first
        self.gate = gate
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.gate is not None:
            await self.gate.wait()
        if self.first:
            self.pulled += len(self.first)
            yield self.first
        block = b"x" * CHUNK
        while self.pulled < self.size:
            piece = block[: min(CHUNK, self.size - self.pulled)]
            self.pulled += len(piece)
            yield piece


async def send_counted(app: ASGIApp, method: str, path: str, body: CountedBody, *, declared: bool,
                       headers: dict[str, str] | None = None) -> httpx.Response:
    """``body`` to ``app``, with a Content-Length of its full size (``declared``) or chunked."""
    sent = dict(headers or {})
    if declared:
        sent["content-length"] = str(body.size)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://capsa") as client:
        return await client.request(method, path, content=body, headers=sent)

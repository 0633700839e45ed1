"""capsa.mcp.asgi_transport: requests into an in-process ASGI app, with the response body streamed (not
collected first) and the app stopped when the client closes the response early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from capsa.mcp.asgi_transport import StreamingASGITransport

CHUNK = 64 * 1024


def _app(produced: list[int]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"method": request.method, "path": request.url.path,
                             "query": dict(request.query_params), "size": len(body),
                             "auth": request.headers.get("authorization"), "head": body[:5].decode()},
                            status_code=201)

    async def big(_request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(1000):  # 64 MiB if it were all produced
                produced.append(i)
                yield bytes([i % 256]) * CHUNK

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def broken(_request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            raise RuntimeError("disk gone")

        return StreamingResponse(chunks())

    return Starlette(routes=[Route("/echo/{name}", echo, methods=["POST"]), Route("/big", big),
                             Route("/broken", broken)])


async def test_request_and_response_pass_through() -> None:
    app = _app([])
    async with httpx.AsyncClient(transport=StreamingASGITransport(app), base_url="http://x.internal",
                                 headers={"Authorization": "Bearer k"}) as client:
        response = await client.post("/echo/a%20b", params={"q": "1"}, content=b"hello" * 100_000)
        assert response.status_code == 201
        assert response.json() == {"method": "POST", "path": "/echo/a b", "query": {"q": "1"},
                                   "size": 500_000, "auth": "Bearer k", "head": "hello"}
        assert (await client.get("/nowhere")).status_code == 404


async def test_the_body_streams_and_an_early_close_stops_the_app() -> None:
    produced: list[int] = []
    async with httpx.AsyncClient(transport=StreamingASGITransport(_app(produced)),
                                 base_url="http://x.internal") as client:
        async with client.stream("GET", "/big") as response:
            seen = 0
            async for chunk in response.aiter_raw():
                seen += len(chunk)
                if seen >= 2 * CHUNK:
                    break
        after_close = len(produced)
        await asyncio.sleep(0.3)
    assert seen == 2 * CHUNK
    assert len(produced) == after_close  # the app stopped when the response was closed
    assert after_close <= 2 + 4 + 2  # what was read, the queue, and one chunk on its way: not 1000

    produced.clear()
    async with httpx.AsyncClient(transport=StreamingASGITransport(_app(produced)),
                                 base_url="http://x.internal") as client:
        whole = await client.get("/big")
    assert len(whole.content) == 1000 * CHUNK and len(produced) == 1000


async def test_an_app_failing_mid_body_is_a_read_error() -> None:
    async with httpx.AsyncClient(transport=StreamingASGITransport(_app([])),
                                 base_url="http://x.internal") as client:
        with pytest.raises(httpx.ReadError, match="disk gone"):
            await client.get("/broken")

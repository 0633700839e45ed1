"""The port proxy end to end: HTTP and WebSocket through the API to an app listening inside a (fake) sandbox,
over the guest channel, with the API key and with port tokens; tenant isolation, revocation, ``expose``.

The app (tests/support/port_app.py) runs inside the fake guest as a background command; a fake guest shares
the host's network namespace, so its port is picked free on the host loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from capsa.common.port_tunnel import open_tunnel
from capsa.common.websocket import SocketStream, WebSocketClient, WebSocketRejected
from tests.support import port_app
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def start_app(client: httpx.AsyncClient, session_id: str, port: int) -> None:
    """Copy the app into the sandbox, start it in the background and wait until the proxy reaches it."""
    put = await client.put(f"/v1/sessions/{session_id}/files/content", params={"path": "/tmp/port_app.py"},
                           content=port_app.SOURCE.encode())
    assert put.status_code == 200, put.text
    started = await client.post(f"/v1/sessions/{session_id}/commands",
                                json={"cmd": f"exec python3 /tmp/port_app.py {port}", "background": True})
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while True:
        response = await client.get(f"/v1/sessions/{session_id}/ports/{port}/hello")
        if response.status_code == 200:
            return
        assert_problem(response, 502, "port_unreachable")
        assert time.monotonic() < deadline, "the app in the sandbox did not come up"
        await asyncio.sleep(0.1)


async def new_session(client: httpx.AsyncClient, **body: Any) -> str:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def ws_connect(stack: ApiStack, target: str, headers: list[tuple[str, str]]) -> WebSocketClient:
    url = urlsplit(stack.url)
    stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
    return await WebSocketClient.connect(stream, url.netloc, target, headers=headers)


async def chunks(parts: list[bytes], pause: float = 0.0) -> AsyncIterator[bytes]:
    for part in parts:
        if pause:
            await asyncio.sleep(pause)
        yield part


async def test_http_through_the_proxy_with_the_key_streams_both_ways(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        assert_problem(await client.get(f"/v1/sessions/{sid}/ports/{port}/hello"), 502, "port_unreachable")
        await start_app(client, sid, port)
        base = f"/v1/sessions/{sid}/ports/{port}"

        hello = await client.get(f"{base}/hello", params={"a": "1", "b": "two"})
        assert hello.status_code == 200 and hello.text == "hello from the sandbox"
        seen = json.loads(hello.headers["x-seen"])
        # The app sees its own path and query, not the API key, and where the proxy put it.
        assert seen == {"path": "/hello", "query": "a=1&b=two", "host": f"localhost:{port}",
                        "authorization": None, "port_token": None, "prefix": base}
        assert (await client.get(f"{base}/nope")).status_code == 404  # the app's own 404, passed through

        # A 24 MiB download, streamed, with the app's Content-Length.
        n = 24 * 1024 * 1024
        digest = hashlib.sha256()
        got = 0
        async with client.stream("GET", f"{base}/bytes", params={"n": n}) as response:
            assert response.status_code == 200 and response.headers["content-length"] == str(n)
            async for piece in response.aiter_bytes():
                digest.update(piece)
                got += len(piece)
        assert got == n
        assert digest.hexdigest() == hashlib.sha256((b"0123456789" * (n // 10 + 1))[:n]).hexdigest()

        # The response is relayed as it comes: the first chunk arrives long before the app finishes.
        started = time.monotonic()
        async with client.stream("GET", f"{base}/slow") as response:
            pieces = response.aiter_raw()
            first = await anext(pieces)
            first_at = time.monotonic() - started
            rest = b"".join([p async for p in pieces])
        assert first == b"first" and rest == b"second"
        assert first_at < 1.2, first_at

        # Uploads: a chunked streamed body (8 MiB in pieces) and a Content-Length one come back whole.
        parts = [bytes([i]) * (1024 * 1024) for i in range(8)]
        echo = await client.post(f"{base}/echo", content=chunks(parts))
        body = b"".join(parts)
        assert echo.status_code == 200 and echo.content == body
        assert echo.headers["x-sha256"] == hashlib.sha256(body).hexdigest()
        put = await client.put(f"{base}/echo", content=b"x" * 100_000)
        assert put.status_code == 200 and put.content == b"x" * 100_000
        head = await client.head(f"{base}/hello")  # the app's length, and no body
        assert head.status_code == 200 and head.headers["content-length"] == "22" and head.content == b""
        after = await client.get(f"{base}/hello")  # the connection to the API is still in step
        assert after.text == "hello from the sandbox"


async def test_request_and_response_bodies_stream_at_once_full_duplex(stack: ApiStack) -> None:
    """The proxy relays each request chunk as it comes and each answer chunk as it comes: the client sends a
    chunk only after the app acknowledged the previous one through the response, which would deadlock if
    the proxy waited for the whole request (or the whole answer)."""
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
    url = urlsplit(stack.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write((f"POST /v1/sessions/{sid}/ports/{port}/duplex HTTP/1.1\r\nHost: {url.netloc}\r\n"
                  f"Authorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    assert head.startswith(b"HTTP/1.1 200"), head
    received = b""
    for word in (b"one", b"two", b"three"):
        writer.write(b"%x\r\n%s\r\n" % (len(word), word))
        await writer.drain()
        while b"got:" + word not in received:
            received += await asyncio.wait_for(reader.read(65536), 20)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    while not received.endswith(b"0\r\n\r\n"):
        more = await asyncio.wait_for(reader.read(65536), 20)
        assert more, received
        received += more
    writer.close()


async def test_websocket_echo_through_the_proxy_with_key_and_token_not_without(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
        made = await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")
        assert made.status_code == 201, made.text
        token = made.json()["token"]
    target = f"/v1/sessions/{sid}/ports/{port}/ws"
    for headers, query in (([("Authorization", f"Bearer {key}")], ""), ([], f"?token={token}"),
                           ([("X-Capsa-Port-Token", token)], "")):
        ws = await ws_connect(stack, target + query, headers)
        await ws.send("hello over websocket")
        assert await ws.receive() == "hello over websocket"
        big = bytes(range(256)) * 4096  # 1 MiB binary message
        await ws.send(big)
        assert await ws.receive() == big
        await ws.close()
    # Without credentials, or with a wrong token, the upgrade is refused with the API's problem answer.
    for headers, query, status, code in (([], "", 401, "unauthorized"),
                                         ([], "?token=cpt_nope", 404, "not_found"),
                                         ([("Authorization", f"Bearer {key}")], "", 502, "port_unreachable")):
        where = target if status != 502 else f"/v1/sessions/{sid}/ports/{free_port()}/ws"
        with pytest.raises(WebSocketRejected) as refused:
            await ws_connect(stack, where + query, headers)
        assert refused.value.status == status
        assert json.loads(refused.value.body)["code"] == code


async def test_an_open_websocket_keeps_the_session_from_its_idle_timeout(
        make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from capsa.control.ports import access as port_access

    monkeypatch.setattr(port_access, "ACTIVITY_INTERVAL", 0.2)
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client, idle_timeout=2)
        await start_app(client, sid, port)
        auth = [("Authorization", f"Bearer {key}")]
        ws = await ws_connect(stack, f"/v1/sessions/{sid}/ports/{port}/ws", auth)
        for i in range(8):  # 4 s of traffic on one connection, twice the idle timeout, no other request
            await asyncio.sleep(0.5)
            await ws.send(f"ping {i}")
            assert await ws.receive() == f"ping {i}"
        await ws.close()
        assert (await client.get(f"/v1/sessions/{sid}")).json()["state"] == "running"
        deadline = time.monotonic() + 20  # closed, it goes idle: the reaper ends the session
        while (await client.get(f"/v1/sessions/{sid}")).json()["state"] == "running":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)


async def test_port_tokens_open_the_port_until_revoked_and_die_with_the_session(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    other = await stack.tenant_key("globex")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
        made = await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")
        assert made.status_code == 201, made.text
        token = made.json()
        assert token["token"].startswith("cpt_") and token["port"] == port and token["session_id"] == sid
        assert token["url"].endswith(f"/v1/sessions/{sid}/ports/{port}/?token={token['token']}")
        second = (await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")).json()
        other_port = (await client.post(f"/v1/sessions/{sid}/ports/{port + 1}/tokens")).json()
    hello = f"/v1/sessions/{sid}/ports/{port}/hello"
    async with stack.client(None) as anon:
        # No credentials at all: 401; a token in the query or in the header: the app answers.
        assert_problem(await anon.get(hello), 401, "unauthorized")
        by_query = await anon.get(hello, params={"token": token["token"], "x": "y"})
        assert by_query.status_code == 200 and by_query.text == "hello from the sandbox"
        seen = json.loads(by_query.headers["x-seen"])
        assert seen["query"] == "x=y" and seen["port_token"] is None  # the token does not reach the app
        by_header = await anon.get(hello, headers={"X-Capsa-Port-Token": token["token"]})
        assert by_header.status_code == 200
        # The token URL as a browser would open it: the answer sets the token as a cookie for this port's
        # path, so the next pages and assets of the tab need no token in their URL.
        opened = await anon.get(token["url"])
        assert opened.status_code == 404  # the app has no "/" page: its own 404
        cookie = opened.headers["set-cookie"]
        assert cookie.startswith(f"capsa_port_token={token['token']}; Path=/v1/sessions/{sid}/ports/{port}/")
        assert "HttpOnly" in cookie
        in_tab = await anon.get(hello, headers={"Cookie": f"theme=dark; capsa_port_token={token['token']}"})
        assert in_tab.status_code == 200 and "set-cookie" not in in_tab.headers
        # A token of another port, an unknown token and a garbage one: 404, as for a missing session.
        assert_problem(await anon.get(hello, params={"token": other_port["token"]}), 404, "not_found")
        assert_problem(await anon.get(hello, params={"token": "cpt_" + "a" * 43}), 404, "not_found")
        assert_problem(await anon.get(hello, params={"token": "nonsense"}), 404, "not_found")
        # An Authorization header that is not a capsa key belongs to the app: passed on with a token.
        app_auth = await anon.get(hello, params={"token": token["token"]},
                                  headers={"Authorization": "Basic eDp5"})
        assert json.loads(app_auth.headers["x-seen"])["authorization"] == "Basic eDp5"
    # Another tenant: its key and its attempts on the tokens' routes see no session.
    async with stack.client(other) as intruder:
        assert_problem(await intruder.get(hello), 404, "not_found")
        assert_problem(await intruder.post(f"/v1/sessions/{sid}/ports/{port}/tokens"), 404, "not_found")
        assert_problem(await intruder.delete(f"/v1/sessions/{sid}/ports/{port}/tokens/{token['id']}"),
                       404, "not_found")
    async with stack.client(key) as client:
        revoked = await client.delete(f"/v1/sessions/{sid}/ports/{port}/tokens/{token['id']}")
        assert revoked.status_code == 204
        assert_problem(await client.delete(f"/v1/sessions/{sid}/ports/{port}/tokens/{token['id']}"),
                       404, "not_found")
    async with stack.client(None) as anon:
        assert_problem(await anon.get(hello, params={"token": token["token"]}), 404, "not_found")
        assert (await anon.get(hello, params={"token": second["token"]})).status_code == 200
    async with stack.client(key) as client:
        assert (await client.post(f"/v1/sessions/{sid}/close")).status_code == 200
        assert_problem(await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens"), 409, "invalid_state")
    async with stack.client(None) as anon:
        assert_problem(await anon.get(hello, params={"token": second["token"]}), 404, "not_found")


async def test_expose_list_refuses_other_ports(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client, expose=[port, port])
        info = (await client.get(f"/v1/sessions/{sid}")).json()
        assert info["expose"] == [port]
        await start_app(client, sid, port)
        assert (await client.get(f"/v1/sessions/{sid}/ports/{port}/hello")).status_code == 200
        other = f"/v1/sessions/{sid}/ports/{port + 1}"
        assert_problem(await client.get(f"{other}/hello"), 403, "port_not_exposed")
        assert_problem(await client.post(f"{other}/tokens"), 403, "port_not_exposed")
        assert_problem(await client.post("/v1/sessions", json={"expose": [0]}), 422, "validation_error")
        plain = await new_session(client)
        assert (await client.get(f"/v1/sessions/{plain}")).json()["expose"] is None


async def test_raw_tunnel_carries_any_tcp_bytes(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
    url = urlsplit(stack.url)
    stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
    tunnel = await open_tunnel(stream, url.netloc, f"/v1/sessions/{sid}/tunnels/{port}",
                               headers=[("Authorization", f"Bearer {key}")])
    await tunnel.write(b"GET /hello HTTP/1.0\r\nHost: x\r\n\r\n")
    await tunnel.end()  # half-close: the app reads EOF, its answer still comes back
    answer = bytearray()
    while data := await tunnel.read():
        answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"hello from the sandbox")
    await tunnel.aclose()
    # A closed port: the tunnel says why in its status message.
    stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
    with pytest.raises(Exception) as refused:
        await open_tunnel(stream, url.netloc, f"/v1/sessions/{sid}/tunnels/{free_port()}",
                          headers=[("Authorization", f"Bearer {key}")])
    assert getattr(refused.value, "code", None) == "port_unreachable"


async def test_sdk_ports_url_get_host_and_forward(stack: ApiStack) -> None:
    from capsa.sdk import AsyncSession, NotFound

    key = await stack.tenant_key("acme")
    port = free_port()
    session = await AsyncSession.create(api_url=stack.url, api_key=key, expose=[port])
    try:
        assert session.info.expose == [port]
        async with stack.client(key) as client:
            await start_app(client, session.id, port)
        assert session.get_host(port) == f"{stack.url}/v1/sessions/{session.id}/ports/{port}/"
        url = await session.ports.url(port, "/hello")
        async with httpx.AsyncClient() as browser:  # no key: the URL alone opens the port
            opened = await browser.get(url)
            assert opened.status_code == 200 and opened.text == "hello from the sandbox"
            # ... and, through the cookie it set, the port's other pages.
            assert (await browser.get(session.get_host(port) + "hello")).status_code == 200
        async with httpx.AsyncClient() as stranger:
            assert_problem(await stranger.get(session.get_host(port) + "hello"), 401, "unauthorized")
        async with await session.ports.forward(port) as forward:
            async with httpx.AsyncClient() as local:
                for _ in range(3):  # one tunnel per connection
                    answer = await local.get(f"http://{forward.local_address}/hello",
                                             headers={"Connection": "close"})
                    assert answer.text == "hello from the sandbox"
                echo = await local.post(f"http://{forward.local_address}/echo", content=b"z" * 3_000_000)
                assert echo.content == b"z" * 3_000_000
            assert forward.connections >= 4
        with pytest.raises(NotFound):
            await (await AsyncSession.connect(session.id, api_url=stack.url,
                                              api_key=await stack.tenant_key("globex"))).ports.url(port)
    finally:
        await session.close()


async def test_cli_port_forward_listens_locally_until_stopped(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
    env = {**os.environ, "CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key}
    capsa = str(Path(sys.executable).with_name("capsa"))
    proc = await asyncio.create_subprocess_exec(
        capsa, "port-forward", sid, str(port), "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        raw = b""
        while not raw.rstrip().endswith(b"}"):
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, (await proc.stderr.read()).decode() if proc.stderr else "no output"
            raw += line
        shown = json.loads(raw)
        assert shown["port"] == port and shown["local_port"] > 0
        async with httpx.AsyncClient() as local:
            answer = await local.get(f"http://{shown['local_address']}/hello")
        assert answer.status_code == 200 and answer.text == "hello from the sandbox"
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0

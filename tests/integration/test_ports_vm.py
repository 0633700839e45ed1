"""Ports of a real sandbox through a real ``capsa serve``: ``python3 -m http.server`` and a WebSocket echo
server inside a microVM without any network device, reached through the API over the guest channel, with
the key and with a port token, not without; a revoked token and another tenant's key get 404.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httpx
import pytest

from capsa.common.websocket import SocketStream, WebSocketClient, WebSocketRejected
from tests.support import port_app
from tests.support.problems import assert_problem
from tests.support.served import Served

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

HTTP_PORT, WS_PORT = 8000, 8001


def _wait_port(client: httpx.Client, sid: str, port: int, path: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        response = client.get(f"/v1/sessions/{sid}/ports/{port}{path}")
        if response.status_code == 200:
            return
        assert_problem(response, 502, "port_unreachable")
        assert time.monotonic() < deadline, f"nothing came up on port {port}"
        time.sleep(0.5)


async def _ws_echo(url: str, target: str, headers: list[tuple[str, str]]) -> list[str | bytes | None]:
    parts = urlsplit(url)
    stream = await SocketStream.connect(parts.hostname or "127.0.0.1", parts.port or 80)
    ws = await WebSocketClient.connect(stream, parts.netloc, target, headers=headers)
    try:
        got: list[str | bytes | None] = []
        for message in ("hello from outside", b"\x00\x01binary" * 5000):
            await ws.send(message)
            got.append(await ws.receive())
        return got
    finally:
        await ws.close()


def test_http_server_and_websocket_in_a_vm_through_the_api(server: tuple[Served, str]) -> None:
    served, admin = server
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {admin}"}, timeout=600) as a:
        acme = a.post("/v1/keys", json={"tenant": "acme-ports"}).json()["key"]
        globex = a.post("/v1/keys", json={"tenant": "globex-ports"}).json()["key"]
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {acme}"}, timeout=600) as c:
        created = c.post("/v1/sessions", json={"expose": [HTTP_PORT, WS_PORT]})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            assert c.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/www/index.txt"},
                         content=b"served from a microVM").status_code == 200
            assert c.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/port_app.py"},
                         content=port_app.SOURCE.encode()).status_code == 200
            for cmd in (f"exec python3 -m http.server {HTTP_PORT} --bind 127.0.0.1 --directory /tmp/www",
                        f"exec python3 /tmp/port_app.py {WS_PORT}"):
                started = c.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd, "background": True})
                assert started.status_code == 201, started.text
            _wait_port(c, sid, HTTP_PORT, "/index.txt")
            _wait_port(c, sid, WS_PORT, "/hello")
            # The VM has no NIC: the guest sees only its loopback interface.
            links = c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "ls /sys/class/net"}).json()
            assert links["stdout"].split() == ["lo"], links

            page = f"/v1/sessions/{sid}/ports/{HTTP_PORT}/index.txt"
            with_key = c.get(page)
            assert with_key.status_code == 200 and with_key.text == "served from a microVM"
            echo = c.post(f"/v1/sessions/{sid}/ports/{WS_PORT}/echo", content=b"e" * 2_000_000)
            assert echo.status_code == 200 and echo.content == b"e" * 2_000_000
            assert_problem(c.get(f"/v1/sessions/{sid}/ports/8002/"), 403, "port_not_exposed")

            token = c.post(f"/v1/sessions/{sid}/ports/{HTTP_PORT}/tokens").json()
            ws_token = c.post(f"/v1/sessions/{sid}/ports/{WS_PORT}/tokens").json()
            with httpx.Client(base_url=served.url, timeout=600) as anon:
                assert_problem(anon.get(page), 401, "unauthorized")
                by_token = anon.get(page, params={"token": token["token"]})
                assert by_token.status_code == 200 and by_token.text == "served from a microVM"
                assert anon.get(urlsplit(token["url"]).path, params={"token": token["token"]}
                                ).status_code == 200  # the directory listing of /tmp/www
            ws_path = f"/v1/sessions/{sid}/ports/{WS_PORT}/ws"
            expected = ["hello from outside", b"\x00\x01binary" * 5000]
            by_key = [("Authorization", f"Bearer {acme}")]
            assert asyncio.run(_ws_echo(served.url, ws_path, by_key)) == expected
            assert asyncio.run(_ws_echo(served.url, f"{ws_path}?token={ws_token['token']}", [])) == expected
            with pytest.raises(WebSocketRejected) as refused:
                asyncio.run(_ws_echo(served.url, ws_path, []))
            assert refused.value.status == 401

            assert c.delete(f"/v1/sessions/{sid}/ports/{HTTP_PORT}/tokens/{token['id']}").status_code == 204
            with httpx.Client(base_url=served.url, timeout=600) as anon:
                assert_problem(anon.get(page, params={"token": token["token"]}), 404, "not_found")
            with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {globex}"},
                              timeout=600) as intruder:
                assert_problem(intruder.get(page), 404, "not_found")
                tokens = f"/v1/sessions/{sid}/ports/{HTTP_PORT}/tokens"
                assert_problem(intruder.post(tokens), 404, "not_found")
            with pytest.raises(WebSocketRejected) as other_tenant:
                asyncio.run(_ws_echo(served.url, ws_path, [("Authorization", f"Bearer {globex}")]))
            assert other_tenant.value.status == 404
            assert json.loads(other_tenant.value.body)["code"] == "not_found"
        finally:
            c.post(f"/v1/sessions/{sid}/close")
        with httpx.Client(base_url=served.url, timeout=600) as anon:
            assert_problem(anon.get(page, params={"token": ws_token["token"]}), 404, "not_found")

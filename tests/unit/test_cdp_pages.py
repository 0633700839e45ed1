"""Kept CDP connections between computer actions (``capsa.control.browser.cdp.CdpPages``), against a loopback
DevTools endpoint that answers ``/json/list`` and page WebSockets the way Chromium does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from capsa.common.port_tunnel import PortTunnel
from capsa.common.websocket import SocketStream
from capsa.control.browser.cdp import CdpError, CdpPage, CdpPages
from capsa.control.browser.computer import Screen, set_screen

pytestmark = pytest.mark.timeout(60)


class DevTools:
    def __init__(self) -> None:
        self.active = "PAGE1"
        self.upgrades: list[str] = []
        self.methods: list[str] = []
        self.drop_next = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /json/list"):
            body = json.dumps([{"type": "page", "id": self.active}, {"type": "service_worker", "id": "W"}])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
            await writer.drain()
            writer.close()
            return
        ws = WSConnection(ConnectionType.SERVER)
        ws.receive_data(head)
        for event in ws.events():
            if isinstance(event, Request):
                self.upgrades.append(event.target)
                writer.write(ws.send(AcceptConnection()))
        while data := await reader.read(65536):
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, TextMessage):
                    command = json.loads(event.data)
                    self.methods.append(command["method"])
                    if self.drop_next:  # the browser goes away mid-command
                        self.drop_next = False
                        writer.close()
                        return
                    writer.write(ws.send(TextMessage(data=json.dumps({"id": command["id"], "result": {}}))))
                elif isinstance(event, CloseConnection):
                    writer.write(ws.send(event.response()))
                    writer.close()
                    return
            await writer.drain()


@pytest.fixture
async def devtools() -> AsyncIterator[tuple[DevTools, Any]]:
    fake = DevTools()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def open_tunnel() -> PortTunnel:
        return cast(PortTunnel, await SocketStream.connect("127.0.0.1", port))

    yield fake, open_tunnel
    server.close()


async def _click(page: CdpPage) -> dict[str, Any]:
    return await page.call("Input.dispatchMouseEvent", {"type": "mousePressed", "x": 1, "y": 1})


async def test_one_connection_and_one_screen_override_for_many_actions(
        devtools: tuple[DevTools, Any]) -> None:
    fake, open_tunnel = devtools
    pages = CdpPages()
    screen = Screen(800, 600)

    async def act(sandbox: str = "sbx_1", on: Screen = screen) -> None:
        await pages.use("ses_1", sandbox, open_tunnel, on, lambda p: set_screen(p, on), _click)

    for _ in range(3):
        await act()
    assert fake.upgrades == ["/devtools/page/PAGE1"]
    assert fake.methods.count("Emulation.setDeviceMetricsOverride") == 1
    assert fake.methods.count("Input.dispatchMouseEvent") == 3
    # Another screen: the override again, on the same connection.
    await act(on=Screen(640, 480))
    assert len(fake.upgrades) == 1 and fake.methods.count("Emulation.setDeviceMetricsOverride") == 2
    # Another active page, or another sandbox (a resume): a new connection, and the override on it.
    fake.active = "PAGE2"
    await act(on=Screen(640, 480))
    await act(sandbox="sbx_2", on=Screen(640, 480))
    assert fake.upgrades == ["/devtools/page/PAGE1", "/devtools/page/PAGE2", "/devtools/page/PAGE2"]
    assert fake.methods.count("Emulation.setDeviceMetricsOverride") == 4
    await pages.aclose()


async def test_a_connection_the_browser_dropped_is_replaced(devtools: tuple[DevTools, Any]) -> None:
    fake, open_tunnel = devtools
    pages = CdpPages()
    screen = Screen(800, 600)
    await pages.use("ses_1", "sbx_1", open_tunnel, screen, lambda p: set_screen(p, screen), _click)
    fake.drop_next = True
    with pytest.raises(CdpError) as info:
        await pages.use("ses_1", "sbx_1", open_tunnel, screen, lambda p: set_screen(p, screen), _click)
    assert info.value.closed
    await pages.use("ses_1", "sbx_1", open_tunnel, screen, lambda p: set_screen(p, screen), _click)
    assert len(fake.upgrades) == 2
    await pages.aclose()


async def test_idle_connections_are_closed(devtools: tuple[DevTools, Any]) -> None:
    fake, open_tunnel = devtools
    pages = CdpPages(idle_s=0.0)
    screen = Screen(800, 600)
    for sid in ("ses_1", "ses_2"):
        await pages.use(sid, "sbx_1", open_tunnel, screen, lambda p: set_screen(p, screen), _click)
    # ses_1's connection was idle past idle_s when ses_2 acted, so it was closed; ses_2 reconnects too.
    await pages.use("ses_1", "sbx_1", open_tunnel, screen, lambda p: set_screen(p, screen), _click)
    assert len(fake.upgrades) == 3
    await pages.aclose()

"""The ``desktop`` template end to end with real microVMs behind the real API stack: computer-use actions
on the X screen (xdotool, scrot) at the session's screen size open the test site with keys, click a button
and type into a field, and the next screenshots show it (pixels compared); the noVNC live view answers
through the ports proxy with a port token (the page, and the websockify WebSocket's RFB greeting); a
click sent over RFB to the view-only VNC port never reaches the page while one to the interactive port does
(the page lists its button's clicks: see :func:`_view_only_then_interactive`), and a view-only token does
not open the interactive port; a second session restores with the desktop running; closing leaves
nothing on the host.

The site is served from a namespace the test makes (tests.support.outside, tests.support.browser_site).
The template is built on first use and cached under /var/cache/capsa/templates (keyed by the spec's
content), so only the first run on a machine pays for the build. Everything is slow under TCG: the
timeouts are generous and nothing asserts on time; the measured figures are printed.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from playwright.async_api import Playwright, async_playwright

from capsa.common.image import GuestImage
from capsa.common.websocket import SocketStream, WebSocketClient
from capsa.node.storage import StoragePool
from tests.support.browser_site import site_handler
from tests.support.leftovers import netns_with, pool_sandbox_dirs, wait_for_nothing, wait_no_vm_leftovers
from tests.support.outside import outside_world
from tests.support.png import dark_fraction, differing, png_pixels
from tests.support.site_egress import site_egress, template_stack

pytestmark = [
    pytest.mark.vm,
    pytest.mark.shipped_templates,
    pytest.mark.root,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

SITE = "shop.test"
SCREEN = (1024, 768)
_LONG = 180_000  # ms: Playwright timeouts under TCG
ADDRESS_BAR = (160, 44, 860, 82)
"""A box inside Chromium's address bar on the session's screen: it looks different once it has the focus."""


async def _act(api: httpx.AsyncClient, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await api.post(f"/v1/sessions/{sid}/computer", json=body, timeout=300)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


async def _shot(api: httpx.AsyncClient, sid: str, size: tuple[int, int] = SCREEN) -> list[bytes]:
    shot = await _act(api, sid, {"action": "screenshot"})
    assert shot["media_type"] == "image/png" and (shot["width"], shot["height"]) == size
    width, height, rows = png_pixels(base64.b64decode(shot["data"]))
    assert (width, height) == size
    return rows


async def _session(api: httpx.AsyncClient, screen: tuple[int, int] | None) -> str:
    body: dict[str, Any] = {"template": "desktop", "memory_mib": 1024,
                            "policy": {"domains": [{"domain": SITE}]}}
    if screen is not None:
        body["metadata"] = {"screen": f"{screen[0]}x{screen[1]}"}
    response = await api.post("/v1/sessions", timeout=3000, json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def _guest(api: httpx.AsyncClient, sid: str, script: str) -> str:
    response = await api.post(f"/v1/sessions/{sid}/commands", timeout=600, json={
        "cmd": ["sh", "-c", script], "env": {"DISPLAY": ":0"}, "timeout": 300})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["exit_code"] == 0, result
    return str(result["stdout"])


async def _until(check: Any, what: str, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"{what} within {within:g} s"
        await asyncio.sleep(1)


async def _changed(api: httpx.AsyncClient, sid: str, old: list[bytes], box: tuple[int, int, int, int],
                   what: str) -> list[bytes]:
    """The first screenshot (within 120 s) in which more than 50 pixels of ``box`` differ from ``old``."""
    deadline = time.monotonic() + 120
    while True:
        rows = await _shot(api, sid)
        if differing(old, rows, box) > 50:
            return rows
        assert time.monotonic() < deadline, f"{what} within 120 s"
        await asyncio.sleep(1)


async def _settled(api: httpx.AsyncClient, sid: str, old: list[bytes], box: tuple[int, int, int, int],
                   what: str) -> list[bytes]:
    """Like :func:`_changed`, then until two screenshots a second apart agree on ``box`` (within the 50
    pixels a blinking caret may take): what the input did once Chromium has painted all of it (a repaint
    of an earlier click's focus can come first)."""
    rows = await _changed(api, sid, old, box, what)
    deadline = time.monotonic() + 120
    while True:
        await asyncio.sleep(1)
        again = await _shot(api, sid)
        if differing(rows, again, box) <= 50:
            return again
        assert time.monotonic() < deadline, f"{what}, and then stopped changing, within 120 s"
        rows = again


def _focus_ring(rows: list[bytes]) -> int:
    """Pixels of Chromium's focus blue (about #0b57d0: its ring and selection) in ``ADDRESS_BAR``: about
    4,000 while the address bar has the focus, none otherwise."""
    x0, y0, x1, y1 = ADDRESS_BAR
    bpp = len(rows[0]) // SCREEN[0]  # RGB or RGBA
    found = 0
    for row in rows[y0:y1]:
        for x in range(x0, x1):
            r, g, b = row[bpp * x:bpp * x + 3]
            found += b > 150 and r < 100 and g < 160
    return found


class Rfb:
    """The client side of an RFB (VNC) connection over the live view's WebSocket (websockify)."""

    def __init__(self, ws: WebSocketClient) -> None:
        self._ws = ws
        self._buf = b""
        self._bytes_per_pixel = 4

    @classmethod
    async def open(cls, api_url: str, live_url: str) -> Rfb:
        """Connect as noVNC does: the WebSocket at the live URL's ``path`` (the token in it, no API key)."""
        path = parse_qs(urlsplit(live_url).query)["path"][0]
        api = urlsplit(api_url)
        stream = await SocketStream.connect(api.hostname or "127.0.0.1", api.port or 80)
        return cls(await WebSocketClient.connect(stream, api.netloc, "/" + path, subprotocols=["binary"]))

    async def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            message = await asyncio.wait_for(self._ws.receive(), 120)
            assert isinstance(message, bytes), f"the VNC server closed or sent text: {message!r}"
            self._buf += message
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    async def handshake(self) -> tuple[bytes, int, int]:
        """Version, no authentication, shared ClientInit; the server's greeting and screen size."""
        greeting = await self.read(12)
        await self._ws.send(b"RFB 003.008\n")
        count = (await self.read(1))[0]
        types = await self.read(count)
        assert 1 in types, f"the VNC server wants authentication: {types!r}"
        await self._ws.send(b"\x01")
        assert struct.unpack(">I", await self.read(4))[0] == 0, "security handshake failed"
        await self._ws.send(b"\x01")  # shared
        width, height = struct.unpack(">HH", await self.read(4))
        pixel_format = await self.read(16)  # bits per pixel first
        self._bytes_per_pixel = pixel_format[0] // 8
        (name_length,) = struct.unpack(">I", await self.read(4))
        await self.read(name_length)
        return greeting, width, height

    async def click(self, x: int, y: int) -> None:
        for mask in (0, 1, 0):
            await self._ws.send(struct.pack(">BBHH", 5, mask, x, y))
            await asyncio.sleep(0.2)

    async def sync(self) -> None:
        """Return once the server has handled every message this client sent before: an RFB server handles
        a client's messages in order, so its answer to a FramebufferUpdateRequest sent now (non-incremental,
        one pixel, so it must answer at once) comes after it. Raw encoding: the client sent no
        SetEncodings."""
        await self._ws.send(struct.pack(">BBHHHH", 3, 0, 0, 0, 1, 1))
        while True:
            kind = (await self.read(1))[0]
            if kind == 0:  # FramebufferUpdate
                await self.read(1)
                (count,) = struct.unpack(">H", await self.read(2))
                for _ in range(count):
                    _, _, w, h, encoding = struct.unpack(">HHHHi", await self.read(12))
                    assert encoding == 0, f"the VNC server sent encoding {encoding}, not raw"
                    await self.read(w * h * self._bytes_per_pixel)
                return
            if kind == 2:  # Bell
                continue
            if kind == 3:  # ServerCutText
                await self.read(3)
                (length,) = struct.unpack(">I", await self.read(4))
                await self.read(length)
                continue
            raise AssertionError(f"unexpected RFB message type {kind} from the VNC server")

    async def aclose(self) -> None:
        await self._ws.close()


VIEW_ONLY_X, INTERACTIVE_X = 250, 550
"""Where the two VNC clicks land on the test page's button (which spans x 100-700): the page lists each
click's x, so the two can be told apart."""


async def _view_only_then_interactive(api: httpx.AsyncClient, api_url: str, sid: str, pw: Playwright,
                                      view: str, take: str, y: int) -> None:
    """A click over the view-only live view (``view``) never reaches the page; one over the interactive
    view (``take``) does. Deterministic: the view-only click is sent first and that server is made to
    handle it (:meth:`Rfb.sync`: it answers in order); only then is the interactive click sent. Once that
    click is in the page's list (``window.clicks``, over CDP), the list must be exactly it: a view-only
    port that passed input on would have put its click in the list before it. Nothing waits on a sleep."""
    info = await api.get(f"/v1/sessions/{sid}/browser")
    assert info.status_code == 200, info.text
    browser = await pw.chromium.connect_over_cdp(info.json()["cdp_url"], timeout=_LONG)
    try:
        page = browser.contexts[0].pages[0]
        page.set_default_timeout(_LONG)
        await page.wait_for_function("location.href.endsWith('/big') && document.readyState == 'complete' "
                                     "&& Array.isArray(window.clicks)")
        assert await page.evaluate("window.clicks") == [], "the page counted clicks before the VNC ones"

        watcher = await Rfb.open(api_url, view)
        greeting, vnc_w, vnc_h = await watcher.handshake()
        assert greeting.startswith(b"RFB 003.00") and (vnc_w, vnc_h) == SCREEN
        await watcher.click(VIEW_ONLY_X, y)
        await watcher.sync()  # the view-only server has handled the click
        await watcher.aclose()

        driver = await Rfb.open(api_url, take)
        greeting, vnc_w, vnc_h = await driver.handshake()
        assert greeting.startswith(b"RFB 003.00") and (vnc_w, vnc_h) == SCREEN
        await driver.click(INTERACTIVE_X, y)
        await driver.sync()

        def near(x: int, at: int) -> bool:
            return abs(x - at) < (INTERACTIVE_X - VIEW_ONLY_X) // 2

        async def interactive_landed() -> bool:
            return any(near(x, INTERACTIVE_X) for x in await page.evaluate("window.clicks"))

        await _until(interactive_landed, "the interactive VNC click reached the page")
        await driver.aclose()
        clicks = await page.evaluate("window.clicks")
        assert len(clicks) == 1 and near(clicks[0], INTERACTIVE_X), \
            f"the view-only VNC port passed a click on: the page saw clicks at x={clicks} (view-only " \
            f"{VIEW_ONLY_X}, interactive {INTERACTIVE_X})"
    finally:
        await browser.close()  # the CDP client leaves; the page stays


async def test_desktop_sessions_end_to_end(state_dir: Path, pool: StoragePool,
                                           guest_image: GuestImage) -> None:
    octet = 150 + secrets.randbelow(50)
    prefix = f"cdk{secrets.token_hex(3)}-"
    figures: dict[str, float] = {}
    width, height = SCREEN
    async with outside_world(octet, site=site_handler("unused"), site_names=(SITE,)) as world:
        egress = site_egress(world, prefix)
        source, stack = template_stack(state_dir, pool, guest_image, egress, "desktop")
        async with stack, async_playwright() as pw:
            acme = await stack.tenant_key("acme")
            async with stack.client(acme, timeout=600) as api:
                started = time.monotonic()
                sid = await _session(api, SCREEN)  # the first one builds the template or imports it
                figures["first_session_s"] = time.monotonic() - started
                figures["template_origin_built"] = float(source.store.origins.get(("desktop", 1024, 1))
                                                         == "built")

                # 1. A screenshot is a PNG of the session's screen; Chromium's window was made that size.
                t0 = time.monotonic()
                await _shot(api, sid)
                figures["first_screenshot_s"] = time.monotonic() - t0
                geometry = await _guest(api, sid, "xdotool search --onlyvisible --class chromium "
                                                  "getwindowgeometry %@")
                assert f"Geometry: {width}x{height}" in geometry, geometry
                zoom = await _act(api, sid, {"action": "zoom", "region": [10, 20, 310, 220]})
                assert (zoom["width"], zoom["height"]) == (300, 200)
                assert png_pixels(base64.b64decode(zoom["data"]))[:2] == (300, 200)

                # 2. Open the site with keys, as an agent would: ctrl+l, the URL, Return (after a click on
                #    the page, so the window has the keyboard focus whatever the window manager did). Like an
                #    agent, look before typing: Chromium moves the focus to the address bar only once the page
                #    has handed ctrl+l back unhandled (a renderer round trip, long under TCG), and keys that
                #    arrive before then go to the page ("ht" of the URL was lost that way, and the address
                #    bar searched for "tps://shop.test/big").
                #    Chromium opens about:blank with the focus in the address bar, and under TCG a click's
                #    effect can reach the screen after the next screenshot: a baseline taken then still looked
                #    focused, and ctrl+l changed nothing on it (failed once in CI). So the test looks for what
                #    an agent sees, the address bar's blue focus ring: gone after the click, back after
                #    ctrl+l.
                async def ring(present: bool) -> bool:
                    return (_focus_ring(await _shot(api, sid)) > 500) == present

                await _act(api, sid, {"action": "left_click", "coordinate": [width // 2, height // 2]})
                await _until(lambda: ring(False), "the click took the focus from the address bar")
                await _act(api, sid, {"action": "key", "text": "ctrl+l"})
                await _until(lambda: ring(True), "ctrl+l gave the address bar the focus")
                await _act(api, sid, {"action": "type", "text": f"https://{SITE}/big"})
                await _act(api, sid, {"action": "key", "text": "Return"})
                info = await api.get(f"/v1/sessions/{sid}/browser")
                assert info.status_code == 200, info.text
                browser = await pw.chromium.connect_over_cdp(info.json()["cdp_url"], timeout=_LONG)
                page = browser.contexts[0].pages[0]
                page.set_default_timeout(_LONG)
                await page.wait_for_function("location.href.endsWith('/big') && document.readyState == "
                                             "'complete' && !!document.getElementById('big')")
                # Where the page starts on the screen (below Chromium's tab strip and toolbar).
                top = int(await page.evaluate("window.outerHeight - window.innerHeight"))
                await browser.close()  # the CDP client leaves; the page stays
                assert 40 < top < 200, top

                # 3. Clicking the button turns the page black; typing fills the field.
                before = await _shot(api, sid)
                page_area = (0, top + 520, width, height)
                assert dark_fraction(before, page_area) < 0.05
                button = (100, top + 200, 700, top + 500)
                t0 = time.monotonic()
                await _act(api, sid, {"action": "left_click", "coordinate": [400, top + 350]})
                figures["click_s"] = time.monotonic() - t0

                async def went_black() -> bool:
                    return dark_fraction(await _shot(api, sid), page_area) > 0.95

                await _until(went_black, "the page turned black after the click")
                t0 = time.monotonic()
                after = await _shot(api, sid)
                figures["screenshot_s"] = time.monotonic() - t0
                assert differing(before, after, button) > 0
                field = (10, top + 10, 410, top + 70)
                await _act(api, sid, {"action": "left_click", "coordinate": [200, top + 40]})
                empty = await _shot(api, sid)
                t0 = time.monotonic()
                await _act(api, sid, {"action": "type", "text": "x" * 100})
                figures["type_100_s"] = time.monotonic() - t0
                # Chromium repaints a while after the input under TCG: poll the screenshots until the
                # text is all there. (The first change can be the click's focus alone: the field then
                # looked the same again once cleared, and the check below timed out once in CI.)
                typed = await _settled(api, sid, empty, field, "the typed text showed")
                await _act(api, sid, {"action": "key", "text": "ctrl+a"})
                await _act(api, sid, {"action": "key", "text": "BackSpace"})
                await _changed(api, sid, typed, field, "the field was cleared")
                assert (await _act(api, sid, {"action": "cursor_position"}))["coordinate"] == [200, top + 40]
                for bad in ({"action": "left_click", "coordinate": [width, 5]},
                            {"action": "key", "text": "ctrl+nosuchkey"},
                            {"action": "left_click", "coordinate": [5, 5], "text": "hyper"}):
                    refused = await api.post(f"/v1/sessions/{sid}/computer", json=bad)
                    assert refused.status_code == 422 and refused.json()["code"] == "validation_error", bad

                # 4. The live view: noVNC's page and its WebSocket through the ports proxy, token only.
                await _act(api, sid, {"action": "key", "text": "F5"})  # reload: white again

                async def white_again() -> bool:
                    return dark_fraction(await _shot(api, sid), page_area) < 0.05

                await _until(white_again, "the page reloaded white")
                view = (await api.get(f"/v1/sessions/{sid}/browser")).json()["live_url"]
                take = (await api.get(f"/v1/sessions/{sid}/browser", params={"interactive": "true"})
                        ).json()["live_url"]
                assert f"/v1/sessions/{sid}/ports/6081/vnc.html?" in view and "view_only=true" in view
                assert f"/v1/sessions/{sid}/ports/6080/vnc.html?" in take and "view_only=false" in take
                async with httpx.AsyncClient(timeout=300) as anonymous:  # no API key: the token lets it in
                    vnc_page = await anonymous.get(view)
                    assert vnc_page.status_code == 200 and "noVNC" in vnc_page.text
                    view_token = parse_qs(urlsplit(view).query)["token"][0]
                    asset = await anonymous.get(view.split("vnc.html", 1)[0]
                                                + f"app/ui.js?token={view_token}")
                    assert asset.status_code == 200 and "UI" in asset.text
                    other_port = await anonymous.get(take.split("?", 1)[0] + f"?token={view_token}")
                    assert other_port.status_code == 404, "a view-only token opened the interactive port"

                # 5. A click over the view-only server never reaches the button; the interactive one does.
                await _view_only_then_interactive(api, stack.url, sid, pw, view, take, top + 350)
                await _until(went_black, "the interactive VNC click turned the page black")

                # 6. Another session restores with the desktop already running, at the default screen.
                t0 = time.monotonic()
                sid2 = await _session(api, None)
                figures["restore_s"] = time.monotonic() - t0
                await _shot(api, sid2, (1280, 800))
                figures["restore_to_first_screenshot_s"] = time.monotonic() - t0
                for done in (sid2, sid):
                    closed = await api.delete(f"/v1/sessions/{done}")
                    assert closed.status_code in (200, 204), closed.text

            # 7. Nothing left: no QEMU, no VM directory, no namespace or tap of these sandboxes.
            assert wait_no_vm_leftovers(state_dir, timeout=120) == []
            assert wait_for_nothing(lambda: netns_with(prefix) + pool_sandbox_dirs(state_dir),
                                    timeout=60) == []
    print("desktop figures:", figures)

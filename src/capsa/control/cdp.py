"""Speaking the Chrome DevTools Protocol to a sandbox's browser over port tunnels.

The browser (``templates/browser.yaml``) listens for CDP on ``127.0.0.1:9222`` in the guest. The control
plane reaches it like the ports proxy does: a port tunnel per connection (:meth:`NodeClient.open_port`).
Over one tunnel it either asks the DevTools HTTP endpoint (``/json/version``, ``/json/list``) or upgrades
to a CDP WebSocket (a page's ``/devtools/page/<id>``) and exchanges JSON commands. ``Host`` is always
``localhost:9222`` (Chromium's DevTools refuses other host names, a DNS-rebinding guard) and no
``Origin`` is sent (Chromium refuses WebSocket origins it was not started to allow).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import h11

from capsa.common.port_tunnel import PortTunnel
from capsa.common.websocket import WebSocketClient, WebSocketRejected
from capsa.control.errors import ApiError

__all__ = ["CDP_HOST", "CDP_PORT", "BrowserUnavailable", "CdpError", "CdpPage", "OpenTunnel", "devtools_json"]

CDP_PORT = 9222
CDP_HOST = f"localhost:{CDP_PORT}"
_MAX_JSON = 4 << 20
CALL_TIMEOUT = 120.0
"""Seconds one CDP command may take (a screenshot under TCG takes a few)."""

OpenTunnel = Callable[[], Awaitable[PortTunnel]]


class BrowserUnavailable(ApiError):
    code, status, title = "browser_unavailable", 409, "No browser in this session"


class CdpError(ApiError):
    code, status, title = "browser_error", 502, "The browser refused the action"


async def devtools_json(tunnel: PortTunnel, path: str) -> Any:
    """GET ``path`` of the DevTools HTTP endpoint over ``tunnel`` (closed afterwards); its JSON body."""
    conn = h11.Connection(h11.CLIENT)
    try:
        await tunnel.write(conn.send(h11.Request(method="GET", target=path, headers=[
            ("Host", CDP_HOST), ("Connection", "close"), ("Accept", "application/json")])))
        await tunnel.write(conn.send(h11.EndOfMessage()))
        status, body = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await tunnel.read())
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_JSON:
                    raise CdpError(f"the DevTools answer to {path} is too large")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    except h11.RemoteProtocolError as exc:
        raise BrowserUnavailable(f"port {CDP_PORT} does not answer as a DevTools endpoint: {exc}") from None
    finally:
        await tunnel.aclose()
    if status != 200:
        raise BrowserUnavailable(f"the DevTools endpoint answered {path} with HTTP {status}")
    try:
        return json.loads(body)
    except ValueError:
        raise BrowserUnavailable(f"the DevTools endpoint answered {path} with no JSON") from None


class CdpPage:
    """A CDP WebSocket to one page target; :meth:`call` sends a command and waits for its result (events
    that arrive meanwhile are dropped)."""

    def __init__(self, ws: WebSocketClient) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, open_tunnel: OpenTunnel) -> CdpPage:
        """The most recently active page of the browser behind ``open_tunnel`` (two tunnels: one to list
        the targets, one for the WebSocket)."""
        targets = await devtools_json(await open_tunnel(), "/json/list")
        pages = [t for t in targets if isinstance(t, dict) and t.get("type") == "page"] \
            if isinstance(targets, list) else []
        if not pages:
            raise BrowserUnavailable("the browser has no open page")
        target_id = str(pages[0].get("id", ""))
        tunnel = await open_tunnel()
        try:
            ws = await WebSocketClient.connect(tunnel, CDP_HOST, f"/devtools/page/{target_id}")
        except (WebSocketRejected, ConnectionError) as exc:
            await tunnel.aclose()
            raise BrowserUnavailable(f"the browser refused a CDP connection to its page: {exc}") from None
        return cls(ws)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        async with self._lock:
            call_id = next(self._ids)
            await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params or {}}))
            async with asyncio.timeout(CALL_TIMEOUT):
                while True:
                    raw = await self._ws.receive()
                    if raw is None:
                        raise CdpError(f"the browser closed the CDP connection during {method}")
                    try:
                        message = json.loads(raw)
                    except ValueError:
                        continue
                    if not isinstance(message, dict) or message.get("id") != call_id:
                        continue
                    if "error" in message:
                        err = message["error"]
                        detail = err.get("message") if isinstance(err, dict) else err
                        raise CdpError(f"{method}: {detail}")
                    result = message.get("result")
                    return result if isinstance(result, dict) else {}

    async def aclose(self) -> None:
        await self._ws.close()

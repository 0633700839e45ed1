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
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import h11

from capsa.common.port_tunnel import PortTunnel
from capsa.common.websocket import WebSocketClient, WebSocketRejected
from capsa.control.errors import ApiError

__all__ = ["CDP_HOST", "CDP_PORT", "DOWNLOADS_DIR", "BrowserUnavailable", "CdpError", "CdpPage", "CdpPages",
           "OpenTunnel", "active_page", "devtools_json", "pin_downloads"]

_T = TypeVar("_T")

CDP_PORT = 9222
DOWNLOADS_DIR = "/root/Downloads"
"""Where the browser saves downloads (Chromium's default for its user, and what :func:`pin_downloads` keeps
CDP clients to), readable through the files API."""
_DOWNLOAD_METHODS = frozenset({"Browser.setDownloadBehavior", "Page.setDownloadBehavior"})
CDP_HOST = f"localhost:{CDP_PORT}"
_MAX_JSON = 4 << 20
CALL_TIMEOUT = 120.0
"""Seconds one CDP command may take (a screenshot under TCG takes a few)."""

OpenTunnel = Callable[[], Awaitable[PortTunnel]]


class BrowserUnavailable(ApiError):
    code, status, title = "browser_unavailable", 409, "No browser in this session"


class CdpError(ApiError):
    code, status, title = "browser_error", 502, "The browser refused the action"

    def __init__(self, message: str, *, closed: bool = False) -> None:
        super().__init__(message)
        self.closed = closed
        """The connection was gone (not the command refused)."""


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
    async def connect(cls, open_tunnel: OpenTunnel, target_id: str) -> CdpPage:
        """A CDP WebSocket to page ``target_id`` (one tunnel)."""
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
                        raise CdpError(f"the browser closed the CDP connection during {method}", closed=True)
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


async def active_page(open_tunnel: OpenTunnel) -> str:
    """The target id of the browser's most recently active page (``/json/list`` lists it first)."""
    targets = await devtools_json(await open_tunnel(), "/json/list")
    pages = [t for t in targets if isinstance(t, dict) and t.get("type") == "page"] \
        if isinstance(targets, list) else []
    if not pages:
        raise BrowserUnavailable("the browser has no open page")
    return str(pages[0].get("id", ""))


@dataclass
class _Kept:
    key: tuple[str, str]  # (sandbox id, target id)
    page: CdpPage
    screen: object | None = None
    used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class CdpPages:
    """CDP connections to sessions' active pages, kept between computer actions (per control-plane
    process).

    A connection per action costs a port tunnel more and, since a device-metrics override lasts only as
    long as the CDP connection that set it, a relayout of the page to the session's screen and back each
    time. Kept, an action costs the ``/json/list`` that finds the active page and its own commands. A
    connection is replaced when the active page or the session's sandbox (a resume) changes, dropped when
    the browser closed it (the action fails once), and closed after ``idle_s`` unused."""

    def __init__(self, idle_s: float = 300.0) -> None:
        self.idle_s = idle_s
        self._kept: dict[str, _Kept] = {}

    async def use(self, session_id: str, sandbox_id: str, open_tunnel: OpenTunnel, screen: object,
                  set_screen: Callable[[CdpPage], Awaitable[None]],
                  act: Callable[[CdpPage], Awaitable[_T]]) -> _T:
        """Run ``act`` on the session's active page, after ``set_screen`` if this connection has not set
        ``screen`` yet. Actions on one session run one at a time."""
        await self._evict_idle()
        key = (sandbox_id, await active_page(open_tunnel))
        kept = self._kept.get(session_id)
        if kept is not None and kept.key != key:
            self._kept.pop(session_id, None)
            async with kept.lock:  # an action still running on it finishes first
                await _quietly_close(kept.page)
            kept = None
        if kept is None:
            kept = _Kept(key, await CdpPage.connect(open_tunnel, key[1]))
            self._kept[session_id] = kept
        async with kept.lock:
            kept.used = time.monotonic()
            try:
                if kept.screen != screen:
                    await set_screen(kept.page)
                    kept.screen = screen
                return await act(kept.page)
            except CdpError as exc:
                if exc.closed and self._kept.get(session_id) is kept:
                    del self._kept[session_id]
                raise
            finally:
                kept.used = time.monotonic()

    async def _evict_idle(self) -> None:
        now = time.monotonic()
        for sid, kept in list(self._kept.items()):
            if now - kept.used > self.idle_s and not kept.lock.locked():
                del self._kept[sid]
                await _quietly_close(kept.page)

    async def aclose(self) -> None:
        kept, self._kept = list(self._kept.values()), {}
        for k in kept:
            await _quietly_close(k.page)


async def _quietly_close(page: CdpPage) -> None:
    with contextlib.suppress(Exception):
        await page.aclose()


def pin_downloads(message: str) -> str:
    """A CDP client's message on its way to the browser, with any download directory it sets replaced by
    :data:`DOWNLOADS_DIR` (and file names kept: ``allowAndName`` becomes ``allow``).

    Playwright's ``connect_over_cdp`` points downloads at a temporary directory named on the client's host,
    which does not exist in the guest; so does any client that sets its own path. Pinned, a download lands
    under its own name where the files API finds it.

    The message is read as the browser reads it: a real JSON parser (so ``\\u0042rowser.set…`` is the
    same method), commands wrapped in ``Target.sendMessageToTarget`` unwrapped (to any depth the browser
    would), a message whose objects repeat a key is sent on re-encoded as parsed (one key each), and one
    that does not parse is replaced by ``{}``, so the browser cannot read another method or path than this
    check did. Messages that cannot hold such a command (no ``DownloadBehavior`` and no escape in their
    text) pass without being parsed.

    This keeps honest clients' downloads where the files API finds them; it is not a security boundary:
    whoever holds the CDP URL drives a browser running as root in the guest (docs/browser.md)."""
    if "DownloadBehavior" not in message and "\\" not in message:
        return message
    pinned = _pin_text(message, _MAX_NESTING)
    return message if pinned is None else pinned


_MAX_NESTING = 8
_REFUSED = "{}"
"""Sent instead of a message the rewrite could not read (the browser answers it with an error)."""


class _Duplicates(Exception):
    pass


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Duplicates
    return obj


def _pin_text(message: str, depth: int) -> str | None:
    """``message`` rewritten (None: unchanged)."""
    try:
        command = json.loads(message, object_pairs_hook=_strict_object)
        rewrite = False
    except _Duplicates:
        command = json.loads(message)  # the last of each key, as sent on
        rewrite = True
    except (ValueError, RecursionError):
        # Not JSON to this parser: what the browser would make of it is not known, so it gets none of it.
        return _REFUSED
    if not isinstance(command, dict):
        return json.dumps(command) if rewrite else None
    changed = _pin_command(command, depth)
    return json.dumps(command) if changed or rewrite else None


def _pin_command(command: dict[str, Any], depth: int) -> bool:
    method, params = command.get("method"), command.get("params")
    if not isinstance(params, dict):
        return False
    if method in _DOWNLOAD_METHODS:
        if params.get("behavior") in ("allow", "allowAndName") or "downloadPath" in params:
            command["params"] = {**params, "behavior": "allow", "downloadPath": DOWNLOADS_DIR}
            return True
        return False
    if method == "Target.sendMessageToTarget" and isinstance(params.get("message"), str):
        if depth <= 0:  # deeper than any client nests: the inner command is not sent on
            command["params"] = {**params, "message": _REFUSED}
            return True
        inner = _pin_text(params["message"], depth - 1)
        if inner is not None:
            command["params"] = {**params, "message": inner}
            return True
    return False

"""``/v1/sessions/{id}/browser`` (where to drive the session's browser over CDP) and
``/v1/sessions/{id}/computer`` (computer-use actions on its active page).

A session has a browser when its template runs one (``templates/browser.yaml``): Chromium's DevTools on
``127.0.0.1:9222`` in the guest (:data:`capsa.control.browser.cdp.CDP_PORT`). ``GET …/browser`` asks it for
the browser's WebSocket path (``/json/version``) and answers a ``cdp_url`` through the ports proxy with a
port token made for that port (one per call, expiring after ``CAPSA_PORT_TOKEN_TTL``, listed and revoked
with the session's other port tokens, gone with the session), which the stock Playwright client
(``connect_over_cdp``) and any CDP client can open. A session whose template has no browser answers 409
``browser_unavailable``. The screen of the computer actions is the session's ``screen`` metadata
(``"1280x800"``, the default).

A session of a desktop template (``templates/desktop.yaml``, :mod:`capsa.control.browser.desktop`) is driven
on its X screen instead: the computer actions become xdotool and scrot commands in the guest, and ``GET
…/browser`` also answers a ``live_url``, noVNC's page through the ports proxy, view-only unless
``?interactive=true``: the two are different ports in the guest (an ``x11vnc -viewonly`` and one that takes
input), and the port token in the URL is made for that port only, so a view-only URL cannot be turned into an
interactive one.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Body, Query, Request
from pydantic import BaseModel, Field

from capsa.common.node_api import ExecRequest, ExecResult
from capsa.common.port_tunnel import PortTunnel
from capsa.control.browser import desktop
from capsa.control.browser.cdp import (
    CDP_PORT,
    DOWNLOADS_DIR,
    BrowserUnavailable,
    CdpPages,
    OpenTunnel,
    devtools_json,
)
from capsa.control.browser.computer import (
    ComputerAction,
    ComputerResult,
    Screen,
    check_action,
    perform,
    set_screen,
)
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import ValidationFailed
from capsa.control.plane import ControlPlane
from capsa.control.ports.access import create_token
from capsa.control.sessions import relay
from capsa.control.sessions.service import get_session

__all__ = ["BrowserInfo", "router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["browser"], responses=PROBLEMS)

SCREEN_KEY = "screen"
_SCREEN_RE = re.compile(r"^([1-9][0-9]{1,4})x([1-9][0-9]{1,4})$")


class BrowserInfo(BaseModel):
    cdp_url: str = Field(description="CDP WebSocket URL of the browser, through the ports proxy, with a port "
                                     "token: for playwright.chromium.connect_over_cdp and CDP clients")
    live_url: str | None = Field(default=None, description="A live view of the screen (desktop templates)")
    downloads_dir: str = Field(default=DOWNLOADS_DIR, description="Where the browser saves downloads, "
                                                                  "under their own names (files API)")


def _opener(target: relay.SessionTarget) -> OpenTunnel:
    """Port tunnels to the CDP port of the session's sandbox (a running session, looked up once per
    request)."""
    missing = BrowserUnavailable(f"session {target.id} has no browser (nothing listens for CDP on port "
                                 f"{CDP_PORT}; its template is {target.row.template!r})")

    async def open_tunnel() -> PortTunnel:
        return await relay.call(target, lambda node, sandbox: node.open_port(sandbox, CDP_PORT),
                                instead={"port_unreachable": missing})

    return open_tunnel


def _screen(metadata: dict[str, str]) -> Screen:
    raw = metadata.get(SCREEN_KEY)
    if raw is None:
        return Screen()
    m = _SCREEN_RE.match(raw)
    if m is None or not (64 <= int(m[1]) <= 7680 and 64 <= int(m[2]) <= 4320):
        raise ValidationFailed(f"the session's screen metadata {raw!r} is not WIDTHxHEIGHT (64x64 to "
                               "7680x4320)", [{"loc": "metadata.screen", "msg": "bad screen size"}])
    return Screen(int(m[1]), int(m[2]))


def _guest(plane: ControlPlane, tenant: str, session_id: str) -> desktop.RunGuest:
    async def run(request: ExecRequest) -> ExecResult:
        target = await relay.running(plane, tenant, session_id)
        return await relay.call(target, lambda node, sandbox: node.exec(sandbox, request))

    return run


def _desktop_screen(metadata: dict[str, str]) -> Screen:
    screen = _screen(metadata)
    try:
        desktop.check_screen(screen)
    except ValueError as exc:
        raise ValidationFailed(str(exc), [{"loc": "metadata.screen", "msg": str(exc)}]) from None
    return screen


async def _live_url(plane: ControlPlane, tenant: str, session_id: str, base: str, screen: Screen,
                    interactive: bool) -> str:
    """noVNC's page on the view-only or the interactive VNC port, with a token for that port."""
    result = await _guest(plane, tenant, session_id)(ExecRequest(cmd=desktop.screen_command(screen),
                                                                 timeout=desktop.ACTION_TIMEOUT))
    if result.exit_code != 0:
        raise desktop.DesktopError(f"the desktop did not take its screen: {result.stderr.strip()[-500:]}")
    port = desktop.VNC_INTERACTIVE_PORT if interactive else desktop.VNC_VIEW_ONLY_PORT
    token = await create_token(plane, tenant, session_id, port, base)
    page = token.url.split("?", 1)[0].rstrip("/")
    prefix = urlsplit(page).path.strip("/")  # none on the port's own host
    ws_path = f"{prefix}/websockify" if prefix else "websockify"
    ws_path += f"?token={token.token}"
    return (f"{page}/vnc.html?autoconnect=true&reconnect=true&resize=off&view_only="
            f"{'false' if interactive else 'true'}&path={quote(ws_path, safe='')}&token={token.token}")


@router.get("/browser", response_model=BrowserInfo, responses=problems(404, 409))
async def browser_info(session_id: str, request: Request, plane: Plane, caller: Caller,
                       interactive: Annotated[bool, Query(
                           description="live_url takes input (a desktop's interactive VNC port) instead of "
                                       "only showing the screen")] = False) -> BrowserInfo:
    """The CDP URL of the session's browser (a new port token for the CDP port each call) and, on a
    desktop, the live view's URL (a new token for its VNC port)."""
    target = await relay.running(plane, caller.tenant, session_id)
    version = await devtools_json(await _opener(target)(), "/json/version")
    ws = version.get("webSocketDebuggerUrl") if isinstance(version, dict) else None
    path = urlsplit(ws).path if isinstance(ws, str) else ""
    if not path.startswith("/devtools/browser/"):
        raise BrowserUnavailable(f"the browser of session {session_id} names no CDP endpoint")
    base = plane.settings.public_url or str(request.base_url)
    token = await create_token(plane, caller.tenant, session_id, CDP_PORT, base)
    http = token.url.split("?", 1)[0].rstrip("/")  # the port's own host, or its path on the API's
    scheme, rest = http.split("://", 1)
    ws_url = f"{'wss' if scheme == 'https' else 'ws'}://{rest}{path}?token={token.token}"
    session = await get_session(plane, caller.tenant, session_id)
    live_url = None
    if desktop.is_desktop(session.template):
        live_url = await _live_url(plane, caller.tenant, session_id, base, _desktop_screen(
            dict(session.metadata)), interactive)
    return BrowserInfo(cdp_url=ws_url, live_url=live_url)


@router.post("/computer", response_model=ComputerResult, response_model_exclude_none=True,
             responses=problems(404, 409))
async def computer(session_id: str, request: Request, plane: Plane, caller: Caller,
                   action: Annotated[ComputerAction, Body()]) -> ComputerResult:
    """One computer-use action (Anthropic's computer-use tool shapes) on the browser's active page, or on
    a desktop session's X screen."""
    session = await get_session(plane, caller.tenant, session_id)
    on_desktop = desktop.is_desktop(session.template)
    screen = _desktop_screen(dict(session.metadata)) if on_desktop else _screen(dict(session.metadata))
    try:
        check_action(action, screen)
        if on_desktop:
            desktop.command_for(action, screen)  # key and modifier names X knows
    except ValueError as exc:
        raise ValidationFailed(str(exc), [{"loc": "body", "msg": str(exc)}]) from None
    if on_desktop:
        return await desktop.perform(_guest(plane, caller.tenant, session_id), screen, action)
    target = await relay.running(plane, caller.tenant, session_id)
    pages: CdpPages = request.app.state.cdp_pages
    return await pages.use(session_id, target.sandbox_id, _opener(target), screen,
                           lambda page: set_screen(page, screen),
                           lambda page: perform(page, session_id, screen, action))

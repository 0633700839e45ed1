"""``/v1/sessions/{id}/browser`` (where to drive the session's browser over CDP) and
``/v1/sessions/{id}/computer`` (computer-use actions on its active page).

A session has a browser when its template runs one (``templates/browser.yaml``): Chromium's DevTools on
``127.0.0.1:9222`` in the guest (:data:`capsa.control.cdp.CDP_PORT`). ``GET …/browser`` asks it for the
browser's WebSocket path (``/json/version``) and answers a ``cdp_url`` through the ports proxy with a
port token made for that port (one per call, gone with the session), which the stock Playwright client
(``connect_over_cdp``) and any CDP client can open. A session whose template has no browser answers 409
``browser_unavailable``. The screen of the computer actions is the session's ``screen`` metadata
(``"1280x800"``, the default).
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Body, Request
from pydantic import BaseModel, Field

from capsa.common.port_tunnel import PortTunnel
from capsa.control.cdp import CDP_PORT, BrowserUnavailable, CdpPage, OpenTunnel, devtools_json
from capsa.control.computer import ComputerAction, ComputerResult, Screen, check_action, perform
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import ValidationFailed
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.port_access import create_token
from capsa.control.sessions import get_session, node_call_failed, running_session

__all__ = ["BrowserInfo", "router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["browser"], responses=PROBLEMS)

SCREEN_KEY = "screen"
_SCREEN_RE = re.compile(r"^([1-9][0-9]{1,4})x([1-9][0-9]{1,4})$")


class BrowserInfo(BaseModel):
    cdp_url: str = Field(description="CDP WebSocket URL of the browser, through the ports proxy, with a port "
                                     "token: for playwright.chromium.connect_over_cdp and CDP clients")
    live_url: str | None = Field(default=None, description="A live view of the screen (desktop templates)")


def _opener(plane: ControlPlane, tenant: str, session_id: str) -> OpenTunnel:
    async def open_tunnel() -> PortTunnel:
        row, client = await running_session(plane, tenant, session_id)
        assert row.sandbox_id is not None
        try:
            return await client.open_port(row.sandbox_id, CDP_PORT)
        except NodeError as exc:
            if exc.code == "port_unreachable":
                raise BrowserUnavailable(f"session {session_id} has no browser (nothing listens for CDP on "
                                         f"port {CDP_PORT}; its template is {row.template!r})") from None
            raise await node_call_failed(plane, row, exc) from exc

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


@router.get("/browser", response_model=BrowserInfo, responses=problems(404, 409))
async def browser_info(session_id: str, request: Request, plane: Plane, caller: Caller) -> BrowserInfo:
    """The CDP URL of the session's browser (a new port token for the CDP port each call)."""
    version = await devtools_json(await _opener(plane, caller.tenant, session_id)(), "/json/version")
    ws = version.get("webSocketDebuggerUrl") if isinstance(version, dict) else None
    path = urlsplit(ws).path if isinstance(ws, str) else ""
    if not path.startswith("/devtools/browser/"):
        raise BrowserUnavailable(f"the browser of session {session_id} names no CDP endpoint")
    base = plane.settings.public_url or str(request.base_url)
    token = await create_token(plane, caller.tenant, session_id, CDP_PORT, base)
    http = token.url.split("?", 1)[0].rstrip("/")
    scheme, rest = http.split("://", 1)
    ws_url = f"{'wss' if scheme == 'https' else 'ws'}://{rest}{path}?token={token.token}"
    return BrowserInfo(cdp_url=ws_url, live_url=None)


@router.post("/computer", response_model=ComputerResult, response_model_exclude_none=True,
             responses=problems(404, 409))
async def computer(session_id: str, plane: Plane, caller: Caller,
                   action: Annotated[ComputerAction, Body()]) -> ComputerResult:
    """One computer-use action (Anthropic's computer-use tool shapes) on the browser's active page."""
    session = await get_session(plane, caller.tenant, session_id)
    screen = _screen(dict(session.metadata))
    try:
        check_action(action, screen)
    except ValueError as exc:
        raise ValidationFailed(str(exc), [{"loc": "body", "msg": str(exc)}]) from None
    page = await CdpPage.open(_opener(plane, caller.tenant, session_id))
    try:
        return await perform(page, session_id, screen, action)
    finally:
        await page.aclose()

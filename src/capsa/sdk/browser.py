"""``session.browser()`` and ``session.computer``: the session's browser over CDP and computer-use actions.

A session of the ``browser`` template runs Chromium. :meth:`AsyncSession.browser_info` answers the CDP
WebSocket URL (through the API's ports proxy, with a port token), for
``playwright.chromium.connect_over_cdp(info.cdp_url)`` or any CDP client. :class:`AsyncComputer` sends
computer-use actions (the shapes of Anthropic's computer-use tool) to ``POST /v1/sessions/{id}/computer``:
``await s.computer.screenshot()``, ``await s.computer.click(x, y)``, ``type``, ``key``, ``scroll`` ...;
:meth:`AsyncComputer.action` sends any action dict an agent produced as it is.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from capsa.sdk.resource import SessionResource

__all__ = ["ActionResult", "AsyncComputer", "BrowserInfo", "Screenshot"]

Direction = Literal["up", "down", "left", "right"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class BrowserInfo(_Model):
    """``GET /v1/sessions/{id}/browser``"""

    cdp_url: str
    live_url: str | None = None
    downloads_dir: str = "/root/Downloads"
    """Where the browser saves downloads under their own names: ``session.files.read(...)``."""


class ActionResult(_Model):
    """What an action answered: image fields for screenshots, ``coordinate`` for ``cursor_position``."""

    media_type: str | None = None
    data: str | None = None
    width: int | None = None
    height: int | None = None
    coordinate: tuple[int, int] | None = None


class Screenshot(_Model):
    media_type: str
    data: str
    """base64 of the PNG"""
    width: int
    height: int

    @property
    def png(self) -> bytes:
        return base64.b64decode(self.data)


class AsyncComputer(SessionResource):
    """Computer-use actions on one session's browser page."""

    @property
    def _path(self) -> str:
        return f"{self._base}/computer"

    async def action(self, action: dict[str, Any]) -> ActionResult:
        """Send one action as it is (``{"action": "left_click", "coordinate": [x, y]}`` ...)."""
        return await self._call(ActionResult, "POST", self._path, json=action)

    async def screenshot(self) -> Screenshot:
        return await self._call(Screenshot, "POST", self._path, json={"action": "screenshot"})

    async def zoom(self, x0: int, y0: int, x1: int, y1: int) -> Screenshot:
        return await self._call(Screenshot, "POST", self._path, json={
            "action": "zoom", "region": [x0, y0, x1, y1]})

    async def click(self, x: int, y: int, *, button: Literal["left", "right", "middle"] = "left",
                    clicks: Literal[1, 2, 3] = 1) -> None:
        kind = {1: f"{button}_click", 2: "double_click", 3: "triple_click"}[clicks]
        await self.action({"action": kind, "coordinate": [x, y]})

    async def double_click(self, x: int, y: int) -> None:
        await self.action({"action": "double_click", "coordinate": [x, y]})

    async def move(self, x: int, y: int) -> None:
        await self.action({"action": "mouse_move", "coordinate": [x, y]})

    async def drag(self, x0: int, y0: int, x1: int, y1: int) -> None:
        await self.action({"action": "left_click_drag", "start_coordinate": [x0, y0], "coordinate": [x1, y1]})

    async def type(self, text: str) -> None:
        await self.action({"action": "type", "text": text})

    async def key(self, keys: str) -> None:
        """xdotool-style names: ``"ctrl+l"``, ``"Return"``, ``"shift+Tab"``."""
        await self.action({"action": "key", "text": keys})

    async def scroll(self, x: int, y: int, direction: Direction = "down", amount: int = 3) -> None:
        await self.action({"action": "scroll", "coordinate": [x, y], "scroll_direction": direction,
                           "scroll_amount": amount})

    async def wait(self, seconds: float = 1.0) -> None:
        await self.action({"action": "wait", "duration": seconds})

    async def cursor_position(self) -> tuple[int, int]:
        result = await self.action({"action": "cursor_position"})
        return result.coordinate or (0, 0)

"""Blocking twin of :class:`capsa.sdk.browser.AsyncComputer` (``Session.computer``)."""

from __future__ import annotations

from typing import Any, Literal

from capsa.sdk.browser import ActionResult, AsyncComputer, Direction, Screenshot
from capsa.sdk.portal import Blocking

__all__ = ["Computer"]


class Computer(Blocking[AsyncComputer]):
    """See :class:`capsa.sdk.browser.AsyncComputer`."""

    def action(self, action: dict[str, Any]) -> ActionResult:
        return self._portal.call(self._inner.action(action))

    def screenshot(self) -> Screenshot:
        return self._portal.call(self._inner.screenshot())

    def zoom(self, x0: int, y0: int, x1: int, y1: int) -> Screenshot:
        return self._portal.call(self._inner.zoom(x0, y0, x1, y1))

    def click(self, x: int, y: int, *, button: Literal["left", "right", "middle"] = "left",
              clicks: Literal[1, 2, 3] = 1) -> None:
        self._portal.call(self._inner.click(x, y, button=button, clicks=clicks))

    def double_click(self, x: int, y: int) -> None:
        self._portal.call(self._inner.double_click(x, y))

    def move(self, x: int, y: int) -> None:
        self._portal.call(self._inner.move(x, y))

    def drag(self, x0: int, y0: int, x1: int, y1: int) -> None:
        self._portal.call(self._inner.drag(x0, y0, x1, y1))

    def type(self, text: str) -> None:
        self._portal.call(self._inner.type(text))

    def key(self, keys: str) -> None:
        self._portal.call(self._inner.key(keys))

    def scroll(self, x: int, y: int, direction: Direction = "down", amount: int = 3) -> None:
        self._portal.call(self._inner.scroll(x, y, direction, amount))

    def wait(self, seconds: float = 1.0) -> None:
        self._portal.call(self._inner.wait(seconds))

    def cursor_position(self) -> tuple[int, int]:
        return self._portal.call(self._inner.cursor_position())

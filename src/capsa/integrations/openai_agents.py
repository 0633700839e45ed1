"""The OpenAI Agents SDK's computer interface on a capsa session's browser.

``CapsaComputer(session)`` implements ``agents.AsyncComputer`` (``pip install capsa[openai-agents]``) with
the session's computer-use actions (:class:`capsa.sdk.browser.AsyncComputer`), so
``ComputerTool(CapsaComputer(session))`` lets an Agents SDK agent see and drive the sandbox's browser::

    async with AsyncSession.create("browser", memory_mib=1024, policy=...) as s:
        agent = Agent(name="web", tools=[ComputerTool(CapsaComputer(s, width=1280, height=800))])

Buttons ``back``/``forward`` become ``alt+Left``/``alt+Right``; keys are xdotool-style names
(``["ctrl", "l"]`` is ``ctrl+l``); a drag goes through each waypoint with the button held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from agents.computer import AsyncComputer

if TYPE_CHECKING:
    from capsa.sdk import AsyncSession

__all__ = ["CapsaComputer"]

_KEY_NAMES = {"enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape",
              "backspace": "BackSpace", "arrowup": "Up", "arrowdown": "Down", "arrowleft": "Left",
              "arrowright": "Right", "pageup": "Page_Up", "pagedown": "Page_Down", "space": "space",
              "tab": "Tab", "delete": "Delete", "home": "Home", "end": "End"}


def _steps(pixels: int) -> int:
    return max(1, abs(pixels) // 100)


class CapsaComputer(AsyncComputer):
    """An ``agents.AsyncComputer`` acting on ``session``'s browser (a ``browser`` template session)."""

    def __init__(self, session: AsyncSession, *, width: int = 1280, height: int = 800) -> None:
        self._computer = session.computer
        self._size = (width, height)

    @property
    def environment(self) -> Literal["browser"]:
        return "browser"

    @property
    def dimensions(self) -> tuple[int, int]:
        return self._size

    async def screenshot(self) -> str:
        return (await self._computer.screenshot()).data

    async def click(self, x: int, y: int,
                    button: Literal["left", "right", "wheel", "back", "forward"]) -> None:
        if button == "back" or button == "forward":
            await self._computer.key("alt+Left" if button == "back" else "alt+Right")
        elif button == "wheel":
            await self._computer.click(x, y, button="middle")
        else:
            await self._computer.click(x, y, button=button)

    async def double_click(self, x: int, y: int) -> None:
        await self._computer.double_click(x, y)

    async def scroll(self, x: int, y: int, scroll_x: int, scroll_y: int) -> None:
        # Agents give pixels; capsa scrolls in wheel steps of 100 pixels.
        if scroll_y:
            await self._computer.scroll(x, y, "down" if scroll_y > 0 else "up", _steps(scroll_y))
        if scroll_x:
            await self._computer.scroll(x, y, "right" if scroll_x > 0 else "left", _steps(scroll_x))

    async def type(self, text: str) -> None:
        await self._computer.type(text)

    async def wait(self) -> None:
        await self._computer.wait(1.0)

    async def move(self, x: int, y: int) -> None:
        await self._computer.move(x, y)

    async def keypress(self, keys: list[str]) -> None:
        await self._computer.key("+".join(_KEY_NAMES.get(k.lower(), k) for k in keys))

    async def drag(self, path: list[tuple[int, int]]) -> None:
        if len(path) < 2:
            return
        await self._computer.move(*path[0])
        await self._computer.action({"action": "left_mouse_down"})
        for point in path[1:]:
            await self._computer.move(*point)
        await self._computer.action({"action": "left_mouse_up"})

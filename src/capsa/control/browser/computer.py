"""Computer-use actions (the shapes of Anthropic's computer-use tool) carried out on a browser page via CDP.

:data:`ComputerAction` is the discriminated union the API validates (``action`` names the variant);
:func:`perform` runs one on a :class:`~capsa.control.browser.cdp.CdpPage`. The page's viewport is set to the
session's screen (``Emulation.setDeviceMetricsOverride``) before every action, so coordinates are CSS pixels
of a ``width`` x ``height`` screen and a screenshot is exactly that size. Mouse input is
``Input.dispatchMouseEvent``, keys ``Input.dispatchKeyEvent`` (xdotool-style names: ``ctrl+l``,
``Return``, ``Page_Down``), text ``Input.insertText``. The last pointer position is remembered per session
in this process (``cursor_position``).
"""

from __future__ import annotations

import asyncio
import base64
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from capsa.control.browser.cdp import CdpPage

__all__ = ["ComputerAction", "ComputerResult", "KeyCombo", "Screen", "check_action", "forget_cursor",
           "parse_keys", "perform", "set_screen"]

Coordinate = Annotated[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]],
                       Field(description="[x, y] in screen pixels")]
Region = Annotated[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)],
                         Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]],
                   Field(description="[x0, y0, x1, y1] in screen pixels")]
_MODIFIER_TEXT = Annotated[str | None, Field(default=None, max_length=64,
                                             description="keys held during the click, e.g. 'shift'")]


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Screenshot(_Action):
    action: Literal["screenshot"]


class CursorPosition(_Action):
    action: Literal["cursor_position"]


class Click(_Action):
    action: Literal["left_click", "right_click", "middle_click", "double_click", "triple_click"]
    coordinate: Coordinate | None = None
    """Where (default: where the pointer is)."""
    text: _MODIFIER_TEXT = None


class MouseMove(_Action):
    action: Literal["mouse_move"]
    coordinate: Coordinate


class MouseButton(_Action):
    action: Literal["left_mouse_down", "left_mouse_up"]


class Drag(_Action):
    action: Literal["left_click_drag"]
    start_coordinate: Coordinate | None = None
    coordinate: Coordinate


class TypeText(_Action):
    action: Literal["type"]
    text: Annotated[str, Field(min_length=1, max_length=100_000)]


class _KeysAction(_Action):
    """An action whose ``text`` names keys (xdotool style, :func:`parse_keys`); unknown names are refused.
    Subclasses narrow both fields (declared here in the order the subclasses' schemas list them)."""

    action: str
    text: str

    @model_validator(mode="after")
    def _known(self) -> Self:
        parse_keys(self.text)
        return self


class Key(_KeysAction):
    action: Literal["key"]
    text: Annotated[str, Field(min_length=1, max_length=256, description="e.g. 'ctrl+l', 'Return'")]


class HoldKey(_KeysAction):
    action: Literal["hold_key"]
    text: Annotated[str, Field(min_length=1, max_length=256)]
    duration: Annotated[float, Field(ge=0, le=30)]


class Scroll(_Action):
    action: Literal["scroll"]
    coordinate: Coordinate | None = None
    scroll_direction: Literal["up", "down", "left", "right"]
    scroll_amount: Annotated[int, Field(ge=0, le=100)] = 3
    text: _MODIFIER_TEXT = None


class Wait(_Action):
    action: Literal["wait"]
    duration: Annotated[float, Field(ge=0, le=30)] = 1.0


class Zoom(_Action):
    action: Literal["zoom"]
    region: Region


ComputerAction = Annotated[
    Screenshot | CursorPosition | Click | MouseMove | MouseButton | Drag | TypeText | Key | HoldKey | Scroll
    | Wait | Zoom,
    Field(discriminator="action")]


class ComputerResult(BaseModel):
    """A screenshot (``screenshot``, ``zoom``) has the image fields; ``cursor_position`` the coordinate;
    other actions answer an empty object."""

    media_type: Literal["image/png"] | None = None
    data: str | None = Field(default=None, description="base64 of the PNG")
    width: int | None = None
    height: int | None = None
    coordinate: tuple[int, int] | None = None


@dataclass(frozen=True)
class Screen:
    width: int = 1280
    height: int = 800

    def check(self, *points: tuple[int, int] | None) -> None:
        for p in points:
            if p is not None and not (p[0] < self.width and p[1] < self.height):
                raise ValueError(f"coordinate {list(p)} is outside the {self.width}x{self.height} screen")


# -- keys ---------------------------------------------------------------------------------------------------

_MODIFIERS = {"alt": 1, "ctrl": 2, "control": 2, "meta": 4, "super": 4, "cmd": 4, "win": 4, "shift": 8}
_MODIFIER_KEYS = {1: ("Alt", "AltLeft", 18), 2: ("Control", "ControlLeft", 17), 4: ("Meta", "MetaLeft", 91),
                  8: ("Shift", "ShiftLeft", 16)}
_NAMED: dict[str, tuple[str, str, int, str]] = {
    # xdotool name (lower case) -> (key, code, windows virtual key code, text)
    "return": ("Enter", "Enter", 13, "\r"), "enter": ("Enter", "Enter", 13, "\r"),
    "kp_enter": ("Enter", "NumpadEnter", 13, "\r"), "tab": ("Tab", "Tab", 9, ""),
    "escape": ("Escape", "Escape", 27, ""), "esc": ("Escape", "Escape", 27, ""),
    "backspace": ("Backspace", "Backspace", 8, ""), "delete": ("Delete", "Delete", 46, ""),
    "insert": ("Insert", "Insert", 45, ""), "space": (" ", "Space", 32, " "),
    "up": ("ArrowUp", "ArrowUp", 38, ""), "down": ("ArrowDown", "ArrowDown", 40, ""),
    "left": ("ArrowLeft", "ArrowLeft", 37, ""), "right": ("ArrowRight", "ArrowRight", 39, ""),
    "home": ("Home", "Home", 36, ""), "end": ("End", "End", 35, ""),
    "page_up": ("PageUp", "PageUp", 33, ""), "prior": ("PageUp", "PageUp", 33, ""),
    "page_down": ("PageDown", "PageDown", 34, ""), "next": ("PageDown", "PageDown", 34, ""),
    **{f"f{i}": (f"F{i}", f"F{i}", 111 + i, "") for i in range(1, 13)},
}
_PUNCT = {"-": ("Minus", 189), "=": ("Equal", 187), "[": ("BracketLeft", 219), "]": ("BracketRight", 221),
          ";": ("Semicolon", 186), "'": ("Quote", 222), ",": ("Comma", 188), ".": ("Period", 190),
          "/": ("Slash", 191), "\\": ("Backslash", 220), "`": ("Backquote", 192)}
_ALIASES = {"minus": "-", "equal": "=", "plus": "+", "comma": ",", "period": ".", "slash": "/",
            "semicolon": ";", "apostrophe": "'", "bracketleft": "[", "bracketright": "]",
            "backslash": "\\", "grave": "`"}


@dataclass(frozen=True)
class KeyCombo:
    modifiers: int
    """CDP bit mask: Alt 1, Ctrl 2, Meta 4, Shift 8"""
    key: str
    code: str
    key_code: int
    text: str


def _one_key(name: str) -> tuple[str, str, int, str]:
    lowered = name.lower().replace("-", "_") if len(name) > 1 else name
    lowered = _ALIASES.get(lowered, lowered)
    if lowered in _NAMED:
        return _NAMED[lowered]
    if len(lowered) == 1:
        ch = lowered
        if ch.isascii() and ch.isalpha():
            return (ch, f"Key{ch.upper()}", ord(ch.upper()), ch)
        if ch.isdigit():
            return (ch, f"Digit{ch}", ord(ch), ch)
        if ch in _PUNCT:
            code, vk = _PUNCT[ch]
            return (ch, code, vk, ch)
        if ch.isprintable():
            return (ch, "", 0, ch)
    raise ValueError(f"unknown key {name!r}")


def parse_keys(text: str) -> list[KeyCombo]:
    """``"ctrl+l"``, ``"Return"``, ``"ctrl+shift+t space"`` (combos separated by spaces)."""
    combos = []
    for chord in text.split():
        parts = chord.split("+") if chord != "+" else ["+"]
        if any(p == "" for p in parts):
            raise ValueError(f"bad key combination {chord!r}")
        mask = 0
        for mod in parts[:-1]:
            bit = _MODIFIERS.get(mod.lower())
            if bit is None:
                raise ValueError(f"unknown modifier {mod!r} in {chord!r}")
            mask |= bit
        last = parts[-1]
        if last.lower() in _MODIFIERS:
            bit = _MODIFIERS[last.lower()]
            key, code, vk = _MODIFIER_KEYS[bit]
            combos.append(KeyCombo(mask | bit, key, code, vk, ""))
            continue
        key, code, vk, ch = _one_key(last)
        if mask & 8 and len(ch) == 1 and ch.isalpha():
            key = ch = ch.upper()
        combos.append(KeyCombo(mask, key, code, vk, "" if mask & 7 else ch))
    if not combos:
        raise ValueError("no key given")
    return combos


def _modifier_mask(text: str | None) -> int:
    if not text:
        return 0
    mask = 0
    for part in text.replace(" ", "+").split("+"):
        if part:
            bit = _MODIFIERS.get(part.lower())
            if bit is None:
                raise ValueError(f"unknown modifier {part!r}")
            mask |= bit
    return mask


# -- performing -------------------------------------------------------------------------------------------

_CURSORS: OrderedDict[str, tuple[int, int]] = OrderedDict()
_MAX_CURSORS = 10_000
_BUTTONS = {"left_click": ("left", 1), "right_click": ("right", 1), "middle_click": ("middle", 1),
            "double_click": ("left", 2), "triple_click": ("left", 3)}


def _cursor(session_id: str) -> tuple[int, int]:
    return _CURSORS.get(session_id, (0, 0))


def _move_cursor(session_id: str, at: tuple[int, int]) -> None:
    _CURSORS[session_id] = at
    _CURSORS.move_to_end(session_id)
    while len(_CURSORS) > _MAX_CURSORS:
        _CURSORS.popitem(last=False)


def forget_cursor(session_id: str) -> None:
    _CURSORS.pop(session_id, None)


async def _mouse(page: CdpPage, kind: str, at: tuple[int, int], *, button: str = "none", clicks: int = 0,
                 modifiers: int = 0, buttons: int = 0) -> None:
    await page.call("Input.dispatchMouseEvent", {"type": kind, "x": at[0], "y": at[1], "button": button,
                                                 "clickCount": clicks, "modifiers": modifiers,
                                                 "buttons": buttons})


async def _keys(page: CdpPage, combo: KeyCombo, *, hold: float = 0.0) -> None:
    held = [bit for bit in (2, 1, 4, 8) if combo.modifiers & bit and _MODIFIER_KEYS[bit][0] != combo.key]
    mask = 0
    for bit in held:
        mask |= bit
        key, code, vk = _MODIFIER_KEYS[bit]
        await page.call("Input.dispatchKeyEvent", {"type": "rawKeyDown", "key": key, "code": code,
                                                   "windowsVirtualKeyCode": vk, "modifiers": mask})
    down: dict[str, Any] = {"type": "keyDown" if combo.text else "rawKeyDown", "key": combo.key,
                            "code": combo.code, "windowsVirtualKeyCode": combo.key_code,
                            "modifiers": combo.modifiers}
    if combo.text:
        down |= {"text": combo.text, "unmodifiedText": combo.text}
    await page.call("Input.dispatchKeyEvent", down)
    if hold:
        await asyncio.sleep(hold)
    await page.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": combo.key, "code": combo.code,
                                               "windowsVirtualKeyCode": combo.key_code,
                                               "modifiers": combo.modifiers})
    for bit in reversed(held):
        key, code, vk = _MODIFIER_KEYS[bit]
        mask &= ~bit
        await page.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": key, "code": code,
                                                   "windowsVirtualKeyCode": vk, "modifiers": mask})


async def _screenshot(page: CdpPage, screen: Screen, region: tuple[int, int, int, int] | None = None
                      ) -> ComputerResult:
    params: dict[str, Any] = {"format": "png"}
    width, height = screen.width, screen.height
    if region is not None:
        x0, y0, x1, y1 = region
        width, height = x1 - x0, y1 - y0
        params["clip"] = {"x": x0, "y": y0, "width": width, "height": height, "scale": 1}
    shot = await page.call("Page.captureScreenshot", params)
    data = str(shot.get("data", ""))
    base64.b64decode(data, validate=True)
    return ComputerResult(media_type="image/png", data=data, width=width, height=height)


async def set_screen(page: CdpPage, screen: Screen) -> None:
    await page.call("Emulation.setDeviceMetricsOverride", {"width": screen.width, "height": screen.height,
                                                           "deviceScaleFactor": 1, "mobile": False})


async def perform(page: CdpPage, session_id: str, screen: Screen, action: Any) -> ComputerResult:
    """Carry out ``action`` (one of :data:`ComputerAction`, already validated and checked against
    ``screen``) on ``page``, whose viewport is ``screen`` already (:func:`set_screen`)."""
    empty = ComputerResult()
    match action:
        case Screenshot():
            return await _screenshot(page, screen)
        case Zoom(region=region):
            return await _screenshot(page, screen, region)
        case CursorPosition():
            return ComputerResult(coordinate=_cursor(session_id))
        case Click(action=kind, coordinate=coordinate, text=text):
            at = coordinate or _cursor(session_id)
            button, clicks = _BUTTONS[kind]
            mods = _modifier_mask(text)
            await _mouse(page, "mouseMoved", at, modifiers=mods)
            for n in range(1, clicks + 1):
                await _mouse(page, "mousePressed", at, button=button, clicks=n, modifiers=mods)
                await _mouse(page, "mouseReleased", at, button=button, clicks=n, modifiers=mods)
            _move_cursor(session_id, at)
        case MouseMove(coordinate=at):
            await _mouse(page, "mouseMoved", at)
            _move_cursor(session_id, at)
        case MouseButton(action=kind):
            at = _cursor(session_id)
            if kind == "left_mouse_down":
                await _mouse(page, "mousePressed", at, button="left", clicks=1, buttons=1)
            else:
                await _mouse(page, "mouseReleased", at, button="left", clicks=1)
        case Drag(start_coordinate=start, coordinate=end):
            begin = start or _cursor(session_id)
            await _mouse(page, "mouseMoved", begin)
            await _mouse(page, "mousePressed", begin, button="left", clicks=1, buttons=1)
            await _mouse(page, "mouseMoved", end, button="left", buttons=1)
            await _mouse(page, "mouseReleased", end, button="left", clicks=1)
            _move_cursor(session_id, end)
        case TypeText(text=text):
            await page.call("Input.insertText", {"text": text})
        case Key(text=text):
            for combo in parse_keys(text):
                await _keys(page, combo)
        case HoldKey(text=text, duration=duration):
            combos = parse_keys(text)
            for combo in combos:
                await _keys(page, combo, hold=duration / len(combos))
        case Scroll(coordinate=coordinate, scroll_direction=direction, scroll_amount=amount, text=text):
            at = coordinate or _cursor(session_id)
            step = 100 * amount
            dx, dy = {"up": (0, -step), "down": (0, step), "left": (-step, 0), "right": (step, 0)}[direction]
            await page.call("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": at[0], "y": at[1],
                                                         "deltaX": dx, "deltaY": dy,
                                                         "modifiers": _modifier_mask(text)})
            _move_cursor(session_id, at)
        case Wait(duration=duration):
            await asyncio.sleep(duration)
        case _:
            raise TypeError(f"not a computer action: {action!r}")
    return empty


def check_action(action: Any, screen: Screen) -> None:
    """Coordinates of ``action`` must be on ``screen`` (ValueError otherwise)."""
    points = [getattr(action, "coordinate", None), getattr(action, "start_coordinate", None)]
    region = getattr(action, "region", None)
    if region is not None:
        x0, y0, x1, y1 = region
        if not (x0 < x1 and y0 < y1):
            raise ValueError("a zoom region needs x0 < x1 and y0 < y1")
        screen.check((x0, y0), (x1 - 1, y1 - 1))
    screen.check(*points)
    _modifier_mask(getattr(action, "text", None) if isinstance(action, Click | Scroll) else None)

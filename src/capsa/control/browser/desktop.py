"""Computer-use actions on a ``desktop`` session's X screen (``templates/desktop.yaml``).

The action models and their validation are :mod:`capsa.control.browser.computer`'s (the same API as on a
``browser`` session); here each action becomes **one guest command**, run through the node's exec like
``POST /v1/sessions/{id}/commands``: the template's helper ``capsa-desktop`` first makes the session's
screen current (a no-op once it is: Chromium's window sized to it, the VNC servers clipped to it), then
runs an xdotool command line (mouse, keys, typing, scrolling, the pointer position) or takes a screenshot
with scrot (base64 PNG on stdout). ``wait`` needs no guest command. :func:`command_for` is the
translation (pure, unit-tested); :func:`perform` runs it and reads the answer.

Key names are the ones :func:`capsa.control.browser.computer.parse_keys` accepts (xdotool style), written as X
keysyms (``return`` -> ``Return``, ``page_down`` -> ``Next``, ``-`` -> ``minus``, ``é`` -> ``U00E9``);
modifiers ``ctrl``, ``alt``, ``shift``, and ``super`` for ``meta``/``cmd``/``win``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from capsa.common.node_api import ExecRequest, ExecResult
from capsa.control.browser.computer import (
    Click,
    ComputerResult,
    CursorPosition,
    Drag,
    HoldKey,
    Key,
    MouseButton,
    MouseMove,
    Screen,
    Screenshot,
    Scroll,
    TypeText,
    Wait,
    Zoom,
    parse_keys,
)
from capsa.control.errors import ApiError

__all__ = ["ACTION_TIMEOUT", "DESKTOP_TEMPLATES", "HELPER", "MAX_SCREEN", "VNC_INTERACTIVE_PORT",
           "VNC_VIEW_ONLY_PORT", "DesktopError", "GuestCommand", "RunGuest", "check_screen", "command_for",
           "is_desktop", "modifier_names", "perform", "screen_command", "xdotool_keys"]

DESKTOP_TEMPLATES = frozenset({"desktop"})
"""Templates whose sessions are driven on the X screen (the others, e.g. ``browser``, through CDP)."""
HELPER = "/usr/local/bin/capsa-desktop"
"""Run like any command, with the node's layout for commands (fixed under TCG by default,
``CAPSA_COMMAND_ASLR``): xdotool's input reaches Chromium the same either way; a fixed layout only starts it
sooner (see ARCHITECTURE.md, commands' layout, for the ctrl+l race that was blamed on it)."""
MAX_SCREEN = (2560, 1600)
"""Xvfb's screen; a session's screen is its top-left part, so it can be at most this."""
VNC_INTERACTIVE_PORT = 6080
"""websockify + noVNC in front of the x11vnc that takes input."""
VNC_VIEW_ONLY_PORT = 6081
"""websockify + noVNC in front of the ``-viewonly`` x11vnc."""
ACTION_TIMEOUT = 300.0
"""Seconds one action's guest command may take (beyond a hold or wait of its own): the first one on a
screen other than the template's restarts the VNC servers, which takes a while under TCG."""
_TYPE_DELAY_MS = 8
_CLICK_DELAY_MS = 80
_SCROLL_DELAY_MS = 30


class DesktopError(ApiError):
    code, status, title = "desktop_error", 502, "The desktop refused the action"


RunGuest = Callable[[ExecRequest], Awaitable[ExecResult]]
"""Runs one command in the session's guest (the node's exec)."""


@dataclass(frozen=True)
class GuestCommand:
    argv: list[str]
    stdin: str | None = None
    answer: Literal["none", "image", "cursor"] = "none"
    size: tuple[int, int] = (0, 0)
    """The image's width and height (``answer == "image"``)."""
    extra_time: float = 0.0
    """Seconds the command spends on purpose (``hold_key``)."""
    env: dict[str, str] = field(default_factory=dict)


def is_desktop(template: str) -> bool:
    return template in DESKTOP_TEMPLATES


def check_screen(screen: Screen) -> None:
    """A desktop's screen must fit Xvfb's (ValueError otherwise)."""
    if screen.width > MAX_SCREEN[0] or screen.height > MAX_SCREEN[1]:
        raise ValueError(f"a desktop screen is at most {MAX_SCREEN[0]}x{MAX_SCREEN[1]}, not "
                         f"{screen.width}x{screen.height}")


def _wxh(screen: Screen) -> str:
    return f"{screen.width}x{screen.height}"


def screen_command(screen: Screen) -> list[str]:
    """Make ``screen`` the session's screen (for the live view before any action)."""
    return [HELPER, "screen", _wxh(screen)]


# -- keys ---------------------------------------------------------------------------------------------------

_X_MODIFIERS = {"alt": "alt", "ctrl": "ctrl", "control": "ctrl", "shift": "shift", "meta": "super",
                "super": "super", "cmd": "super", "win": "super"}
_X_MODIFIER_KEYS = {"alt": "Alt_L", "ctrl": "Control_L", "shift": "Shift_L", "super": "Super_L"}
_X_NAMED = {
    "return": "Return", "enter": "Return", "kp_enter": "KP_Enter", "tab": "Tab", "escape": "Escape",
    "esc": "Escape", "backspace": "BackSpace", "delete": "Delete", "insert": "Insert", "space": "space",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right", "home": "Home", "end": "End",
    "page_up": "Prior", "prior": "Prior", "page_down": "Next", "next": "Next",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}
_X_PUNCT = {
    "-": "minus", "=": "equal", "[": "bracketleft", "]": "bracketright", ";": "semicolon", "'": "apostrophe",
    ",": "comma", ".": "period", "/": "slash", "\\": "backslash", "`": "grave", "+": "plus", "!": "exclam",
    "@": "at", "#": "numbersign", "$": "dollar", "%": "percent", "^": "asciicircum", "&": "ampersand",
    "*": "asterisk", "(": "parenleft", ")": "parenright", "_": "underscore", "{": "braceleft",
    "}": "braceright", "|": "bar", ":": "colon", '"': "quotedbl", "<": "less", ">": "greater",
    "?": "question", "~": "asciitilde",
}
_ALIASES = {"minus": "-", "equal": "=", "plus": "+", "comma": ",", "period": ".", "slash": "/",
            "semicolon": ";", "apostrophe": "'", "bracketleft": "[", "bracketright": "]",
            "backslash": "\\", "grave": "`"}


def _keysym(name: str) -> str:
    lowered = name.lower().replace("-", "_") if len(name) > 1 else name
    lowered = _ALIASES.get(lowered, lowered)
    if lowered in _X_NAMED:
        return _X_NAMED[lowered]
    if len(lowered) == 1:
        if lowered.isascii() and lowered.isalnum():
            return lowered
        if lowered in _X_PUNCT:
            return _X_PUNCT[lowered]
        if lowered.isprintable() and not lowered.isspace():
            return f"U{ord(lowered):04X}"
    raise ValueError(f"unknown key {name!r}")


def xdotool_keys(text: str) -> list[str]:
    """The chords of ``text`` (``"ctrl+l"``, ``"Return"``, ``"ctrl+shift+t space"``) as xdotool key
    arguments; the names accepted are exactly those :func:`parse_keys` accepts."""
    parse_keys(text)
    chords = []
    for chord in text.split():
        parts = chord.split("+") if chord != "+" else ["+"]
        mods: list[str] = []
        for mod in parts[:-1]:
            x = _X_MODIFIERS[mod.lower()]
            if x not in mods:
                mods.append(x)
        last = parts[-1]
        key = _X_MODIFIER_KEYS[_X_MODIFIERS[last.lower()]] if last.lower() in _X_MODIFIERS else _keysym(last)
        chords.append("+".join([*mods, key]))
    return chords


def modifier_names(text: str | None) -> str | None:
    """Held modifiers of a click or scroll (``"shift"``, ``"ctrl+alt"``) for xdotool keydown/keyup."""
    if not text:
        return None
    names: list[str] = []
    for part in text.replace(" ", "+").split("+"):
        if part:
            x = _X_MODIFIERS.get(part.lower())
            if x is None:
                raise ValueError(f"unknown modifier {part!r}")
            if x not in names:
                names.append(x)
    return "+".join(names) or None


# -- actions -> guest commands ------------------------------------------------------------------------------

_BUTTON = {"left_click": ("1", 1), "right_click": ("3", 1), "middle_click": ("2", 1),
           "double_click": ("1", 2), "triple_click": ("1", 3)}
_WHEEL = {"up": "4", "down": "5", "left": "6", "right": "7"}


def _held(mods: str | None, inner: list[str]) -> list[str]:
    return inner if mods is None else ["keydown", mods, *inner, "keyup", mods]


def _move(at: tuple[int, int] | None) -> list[str]:
    return [] if at is None else ["mousemove", str(at[0]), str(at[1])]


def command_for(action: Any, screen: Screen) -> GuestCommand | None:
    """The guest command carrying out ``action`` (validated and checked against ``screen``); None for
    ``wait``, which needs none."""
    act = [HELPER, "act", _wxh(screen), "xdotool"]
    match action:
        case Screenshot():
            return GuestCommand([HELPER, "shot", _wxh(screen)], answer="image",
                                size=(screen.width, screen.height))
        case Zoom(region=(x0, y0, x1, y1)):
            region = f"{x0},{y0},{x1 - x0},{y1 - y0}"
            return GuestCommand([HELPER, "shot", _wxh(screen), region], answer="image",
                                size=(x1 - x0, y1 - y0))
        case CursorPosition():
            return GuestCommand([*act, "getmouselocation", "--shell"], answer="cursor")
        case Click(action=kind, coordinate=coordinate, text=text):
            button, clicks = _BUTTON[kind]
            click = ["click", "--repeat", str(clicks), "--delay", str(_CLICK_DELAY_MS), button]
            return GuestCommand([*act, *_move(coordinate), *_held(modifier_names(text), click)])
        case MouseMove(coordinate=at):
            return GuestCommand([*act, *_move(at)])
        case MouseButton(action=kind):
            return GuestCommand([*act, "mousedown" if kind == "left_mouse_down" else "mouseup", "1"])
        case Drag(start_coordinate=start, coordinate=end):
            return GuestCommand([*act, *_move(start), "mousedown", "1", "sleep", "0.1", *_move(end), "sleep",
                                 "0.1", "mouseup", "1"])
        case TypeText(text=text):
            return GuestCommand([*act, "type", "--delay", str(_TYPE_DELAY_MS), "--file", "-"], stdin=text,
                                extra_time=len(text) * _TYPE_DELAY_MS / 1000)
        case Key(text=text):
            return GuestCommand([*act, "key", "--delay", "50", *xdotool_keys(text)])
        case HoldKey(text=text, duration=duration):
            chords = xdotool_keys(text)
            each = f"{duration / len(chords):g}"
            argv = [*act]
            for chord in chords:
                argv += ["keydown", chord, "sleep", each, "keyup", chord]
            return GuestCommand(argv, extra_time=duration)
        case Scroll(coordinate=coordinate, scroll_direction=direction, scroll_amount=amount, text=text):
            wheel = ["click", "--repeat", str(amount), "--delay", str(_SCROLL_DELAY_MS), _WHEEL[direction]] \
                if amount else []
            argv = [*act, *_move(coordinate), *_held(modifier_names(text), wheel)]
            if len(argv) == len(act):  # nothing to do but make the screen current
                return GuestCommand([HELPER, "screen", _wxh(screen)])
            return GuestCommand(argv)
        case Wait():
            return None
        case _:
            raise TypeError(f"not a computer action: {action!r}")


# -- running ------------------------------------------------------------------------------------------------

_CURSOR_RE = re.compile(r"^(X|Y)=(-?\d+)$", re.MULTILINE)


def _png_size(png: bytes) -> tuple[int, int]:
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise DesktopError("the desktop's screenshot is not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return int(width), int(height)


def _image(stdout: str, size: tuple[int, int]) -> ComputerResult:
    data = stdout.strip()
    try:
        png = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise DesktopError("the desktop's screenshot is not base64") from None
    if _png_size(png) != size:
        raise DesktopError(f"the desktop's screenshot is {_png_size(png)}, not {size}")
    return ComputerResult(media_type="image/png", data=data, width=size[0], height=size[1])


def _cursor(stdout: str) -> ComputerResult:
    found = dict(_CURSOR_RE.findall(stdout))
    if "X" not in found or "Y" not in found:
        raise DesktopError("xdotool did not tell the pointer position")
    return ComputerResult(coordinate=(max(0, int(found["X"])), max(0, int(found["Y"]))))


async def perform(run: RunGuest, screen: Screen, action: Any) -> ComputerResult:
    """Carry out ``action`` (validated and checked against ``screen``) with one guest command."""
    if isinstance(action, Wait):
        await asyncio.sleep(action.duration)
        return ComputerResult()
    command = command_for(action, screen)
    assert command is not None
    result = await run(ExecRequest(cmd=command.argv, stdin=command.stdin, env=command.env,
                                   timeout=ACTION_TIMEOUT + command.extra_time, max_output=64 << 20))
    if result.timed_out:
        raise DesktopError(f"the desktop did not finish the {action.action} action within "
                           f"{ACTION_TIMEOUT + command.extra_time:g} s")
    if result.exit_code != 0:
        detail = result.stderr.strip()[-500:] or f"exit code {result.exit_code}"
        raise DesktopError(f"the desktop refused the {action.action} action: {detail}")
    if command.answer == "image":
        return _image(result.stdout, command.size)
    if command.answer == "cursor":
        return _cursor(result.stdout)
    return ComputerResult()

"""Computer-use actions on a desktop: each action's guest command (the capsa-desktop helper + an xdotool
command line, or a scrot screenshot), X key names, the desktop's screen bound, and how the guest's answers
(base64 PNG, xdotool's pointer position, failures) become results and errors."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from capsa.common.node_api import ExecRequest, ExecResult
from capsa.control.browser.computer import ComputerAction, Screen, check_action
from capsa.control.browser.desktop import (
    HELPER,
    DesktopError,
    check_screen,
    command_for,
    is_desktop,
    modifier_names,
    perform,
    screen_command,
    xdotool_keys,
)

pytestmark = pytest.mark.timeout(60)

_ACTIONS: TypeAdapter[Any] = TypeAdapter(ComputerAction)
SCREEN = Screen(1024, 768)
RUN = [HELPER]
ACT = [*RUN, "act", "1024x768", "xdotool"]


def _command(body: dict[str, Any]) -> tuple[list[str], str | None]:
    action = _ACTIONS.validate_python(body)
    check_action(action, SCREEN)
    command = command_for(action, SCREEN)
    assert command is not None
    return command.argv, command.stdin


@pytest.mark.parametrize(("body", "argv"), [
    ({"action": "left_click", "coordinate": [10, 20]},
     [*ACT, "mousemove", "10", "20", "click", "--repeat", "1", "--delay", "80", "1"]),
    ({"action": "right_click", "coordinate": [1, 2]},
     [*ACT, "mousemove", "1", "2", "click", "--repeat", "1", "--delay", "80", "3"]),
    ({"action": "middle_click"}, [*ACT, "click", "--repeat", "1", "--delay", "80", "2"]),
    ({"action": "double_click", "coordinate": [5, 6]},
     [*ACT, "mousemove", "5", "6", "click", "--repeat", "2", "--delay", "80", "1"]),
    ({"action": "triple_click", "coordinate": [0, 0], "text": "shift"},
     [*ACT, "mousemove", "0", "0", "keydown", "shift", "click", "--repeat", "3", "--delay", "80", "1",
      "keyup", "shift"]),
    ({"action": "mouse_move", "coordinate": [1023, 767]}, [*ACT, "mousemove", "1023", "767"]),
    ({"action": "left_mouse_down"}, [*ACT, "mousedown", "1"]),
    ({"action": "left_mouse_up"}, [*ACT, "mouseup", "1"]),
    ({"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [30, 40]},
     [*ACT, "mousemove", "1", "2", "mousedown", "1", "sleep", "0.1", "mousemove", "30", "40", "sleep", "0.1",
      "mouseup", "1"]),
    ({"action": "key", "text": "ctrl+l"}, [*ACT, "key", "--delay", "50", "ctrl+l"]),
    ({"action": "key", "text": "Return"}, [*ACT, "key", "--delay", "50", "Return"]),
    ({"action": "key", "text": "cmd+shift+Page_Down esc -"},
     [*ACT, "key", "--delay", "50", "super+shift+Next", "Escape", "minus"]),
    ({"action": "hold_key", "text": "shift", "duration": 1},
     [*ACT, "keydown", "Shift_L", "sleep", "1", "keyup", "Shift_L"]),
    ({"action": "scroll", "coordinate": [5, 5], "scroll_direction": "down", "scroll_amount": 3},
     [*ACT, "mousemove", "5", "5", "click", "--repeat", "3", "--delay", "30", "5"]),
    ({"action": "scroll", "scroll_direction": "left", "scroll_amount": 1, "text": "ctrl"},
     [*ACT, "keydown", "ctrl", "click", "--repeat", "1", "--delay", "30", "6", "keyup", "ctrl"]),
    ({"action": "scroll", "scroll_direction": "up", "scroll_amount": 0}, [*RUN, "screen", "1024x768"]),
    ({"action": "cursor_position"}, [*ACT, "getmouselocation", "--shell"]),
    ({"action": "screenshot"}, [*RUN, "shot", "1024x768"]),
    ({"action": "zoom", "region": [10, 20, 110, 70]}, [*RUN, "shot", "1024x768", "10,20,100,50"]),
])
def test_actions_become_one_guest_command(body: dict[str, Any], argv: list[str]) -> None:
    assert _command(body) == (argv, None)


def test_typing_sends_the_text_on_stdin_not_in_argv() -> None:
    text = "hello; $(rm -rf /) 'quoted' — ü\n"
    assert _command({"action": "type", "text": text}) == (
        [*ACT, "type", "--delay", "8", "--file", "-"], text)


def test_wait_needs_no_guest_command() -> None:
    assert command_for(_ACTIONS.validate_python({"action": "wait", "duration": 0.1}), SCREEN) is None


@pytest.mark.parametrize(("text", "chords"), [
    ("ctrl+a", ["ctrl+a"]), ("Control+A", ["ctrl+A"]), ("alt+F4", ["alt+F4"]), ("super", ["Super_L"]),
    ("ctrl+shift", ["ctrl+Shift_L"]), ("shift+Tab", ["shift+Tab"]), ("BackSpace", ["BackSpace"]),
    ("Delete Home End Insert", ["Delete", "Home", "End", "Insert"]),
    ("Up Down Left Right", ["Up", "Down", "Left", "Right"]),
    ("page_up Prior Next", ["Prior", "Prior", "Next"]), ("KP_Enter enter", ["KP_Enter", "Return"]),
    ("space", ["space"]), ("f12", ["F12"]), ("+", ["plus"]), ("ctrl+plus", ["ctrl+plus"]),
    ("ctrl+minus", ["ctrl+minus"]), ("! ? / \\ `", ["exclam", "question", "slash", "backslash", "grave"]),
    ("é", ["U00E9"]), ("meta+win+cmd+c", ["super+c"]), ("7", ["7"]),
])
def test_key_names_become_x_keysyms(text: str, chords: list[str]) -> None:
    assert xdotool_keys(text) == chords


@pytest.mark.parametrize("text", ["ctrl+nosuchkey", "hyper+a", "ctrl++", "", "   "])
def test_unknown_keys_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        xdotool_keys(text)


def test_modifiers_of_clicks() -> None:
    assert modifier_names(None) is None and modifier_names("") is None
    assert modifier_names("shift ctrl") == "shift+ctrl"
    assert modifier_names("cmd+meta") == "super"
    with pytest.raises(ValueError, match="unknown modifier"):
        modifier_names("shift+hyper")
    action = _ACTIONS.validate_python({"action": "left_click", "coordinate": [1, 1], "text": "hyper"})
    with pytest.raises(ValueError):
        check_action(action, SCREEN)


def test_the_desktop_screen_is_bounded_by_xvfbs() -> None:
    check_screen(Screen(2560, 1600))
    check_screen(Screen(64, 64))
    for too_big in (Screen(2561, 100), Screen(100, 1601)):
        with pytest.raises(ValueError, match="at most 2560x1600"):
            check_screen(too_big)
    assert screen_command(Screen(800, 600)) == [*RUN, "screen", "800x600"]
    assert is_desktop("desktop") and not is_desktop("browser") and not is_desktop("base")


def test_coordinates_off_the_screen_are_refused_before_any_command() -> None:
    for body in ({"action": "left_click", "coordinate": [1024, 10]},
                 {"action": "zoom", "region": [0, 0, 1025, 10]},
                 {"action": "left_click_drag", "start_coordinate": [0, 800], "coordinate": [1, 1]}):
        with pytest.raises(ValueError, match=r"outside|screen"):
            check_action(_ACTIONS.validate_python(body), SCREEN)
    with pytest.raises(ValidationError):
        _ACTIONS.validate_python({"action": "mouse_move", "coordinate": [-1, 0]})


# -- the guest's answers ------------------------------------------------------------------------------------


def _png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    raw = b"".join(b"\0" + b"\xff\x00\x00" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


class _Guest:
    """Answers the guest commands with canned results and keeps the requests (the translation's other
    side, the real guest, is tests/integration/test_desktop_vm.py)."""

    def __init__(self, stdout: str = "", exit_code: int = 0, stderr: str = "") -> None:
        self.requests: list[ExecRequest] = []
        self._result = ExecResult(exit_code=exit_code, signal=None, stdout_truncated=False,
                                  stderr_truncated=False, timed_out=False, duration_ms=1.0, stdout=stdout,
                                  stderr=stderr)

    async def __call__(self, request: ExecRequest) -> ExecResult:
        self.requests.append(request)
        return self._result


async def test_a_screenshot_is_the_guests_png_checked_for_its_size() -> None:
    data = base64.b64encode(_png(1024, 768)).decode()
    guest = _Guest(stdout=data + "\n")
    result = await perform(guest, SCREEN, _ACTIONS.validate_python({"action": "screenshot"}))
    assert (result.media_type, result.data, result.width, result.height) == ("image/png", data, 1024, 768)
    assert guest.requests[0].cmd == [*RUN, "shot", "1024x768"]
    zoom = await perform(_Guest(stdout=base64.b64encode(_png(100, 50)).decode()), SCREEN,
                         _ACTIONS.validate_python({"action": "zoom", "region": [10, 20, 110, 70]}))
    assert (zoom.width, zoom.height) == (100, 50)
    with pytest.raises(DesktopError, match="not"):
        await perform(_Guest(stdout=base64.b64encode(_png(10, 10)).decode()), SCREEN,
                      _ACTIONS.validate_python({"action": "screenshot"}))
    with pytest.raises(DesktopError, match="not base64"):
        await perform(_Guest(stdout="%%%"), SCREEN, _ACTIONS.validate_python({"action": "screenshot"}))
    with pytest.raises(DesktopError, match="not a PNG"):
        await perform(_Guest(stdout=base64.b64encode(b"GIF89a" + bytes(30)).decode()), SCREEN,
                      _ACTIONS.validate_python({"action": "screenshot"}))


async def test_the_cursor_position_is_xdotools() -> None:
    guest = _Guest(stdout="X=200\nY=40\nSCREEN=0\nWINDOW=1234\n")
    result = await perform(guest, SCREEN, _ACTIONS.validate_python({"action": "cursor_position"}))
    assert result.coordinate == (200, 40)
    with pytest.raises(DesktopError, match="pointer"):
        await perform(_Guest(stdout="nothing"), SCREEN,
                      _ACTIONS.validate_python({"action": "cursor_position"}))


async def test_a_failing_guest_command_is_a_desktop_error_and_typing_goes_on_stdin() -> None:
    with pytest.raises(DesktopError, match="Can't open display") as caught:
        await perform(_Guest(exit_code=1, stderr="Error: Can't open display"), SCREEN,
                      _ACTIONS.validate_python({"action": "left_click", "coordinate": [1, 1]}))
    assert caught.value.code == "desktop_error" and caught.value.status == 502
    guest = _Guest()
    assert (await perform(guest, SCREEN, _ACTIONS.validate_python({"action": "type", "text": "x" * 100}))
            ).model_dump(exclude_none=True) == {}
    assert guest.requests[0].stdin == "x" * 100 and guest.requests[0].timeout is not None
    assert guest.requests[0].timeout >= 300.8

"""Computer-use actions: the action union, key names, screen bounds, and the API's answers for sessions
without a browser (the fake sandbox runs no Chromium) and for invalid actions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from capsa.control.browser.computer import ComputerAction, KeyCombo, Screen, check_action, parse_keys
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(120)

_ACTIONS: TypeAdapter[Any] = TypeAdapter(ComputerAction)


@pytest.mark.parametrize("body", [
    {"action": "screenshot"},
    {"action": "left_click", "coordinate": [10, 20]},
    {"action": "triple_click", "coordinate": [0, 0], "text": "shift"},
    {"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [30, 40]},
    {"action": "type", "text": "hello"},
    {"action": "key", "text": "ctrl+l"},
    {"action": "key", "text": "Return"},
    {"action": "scroll", "coordinate": [5, 5], "scroll_direction": "down", "scroll_amount": 3},
    {"action": "wait", "duration": 0.5},
    {"action": "cursor_position"},
    {"action": "zoom", "region": [0, 0, 100, 50]},
    {"action": "hold_key", "text": "shift", "duration": 0.1},
])
def test_valid_actions_parse_to_their_variant(body: dict[str, Any]) -> None:
    action = _ACTIONS.validate_python(body)
    assert action.action == body["action"]
    check_action(action, Screen(1280, 800))


@pytest.mark.parametrize("body", [
    {"action": "fly"},
    {"action": "left_click", "coordinate": [-1, 3]},
    {"action": "left_click", "coordinate": [1]},
    {"action": "key", "text": "ctrl+nosuchkey"},
    {"action": "key", "text": "hyper+a"},
    {"action": "type"},
    {"action": "scroll", "coordinate": [1, 1], "scroll_direction": "sideways"},
    {"action": "screenshot", "extra": 1},
])
def test_invalid_actions_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _ACTIONS.validate_python(body)


def test_coordinates_outside_the_screen_are_refused() -> None:
    screen = Screen(640, 480)
    for body in ({"action": "left_click", "coordinate": [640, 10]},
                 {"action": "mouse_move", "coordinate": [10, 480]},
                 {"action": "left_click_drag", "start_coordinate": [700, 1], "coordinate": [1, 1]},
                 {"action": "zoom", "region": [0, 0, 641, 10]},
                 {"action": "zoom", "region": [10, 10, 5, 20]}):
        with pytest.raises(ValueError, match=r"screen|region"):
            check_action(_ACTIONS.validate_python(body), screen)
    check_action(_ACTIONS.validate_python({"action": "left_click", "coordinate": [639, 479]}), screen)


def test_key_names_map_to_cdp_key_events() -> None:
    assert parse_keys("ctrl+l") == [KeyCombo(2, "l", "KeyL", ord("L"), "")]
    assert parse_keys("Return") == [KeyCombo(0, "Enter", "Enter", 13, "\r")]
    assert parse_keys("shift+a") == [KeyCombo(8, "A", "KeyA", ord("A"), "A")]
    assert parse_keys("Page_Down")[0].key == "PageDown"
    combos = parse_keys("ctrl+shift+t space")
    assert [c.modifiers for c in combos] == [10, 0] and combos[1].text == " "
    assert parse_keys("shift")[0].key == "Shift"
    for bad in ("", "ctrl+", "nosuchkey", "ctrl+alt+foo"):
        with pytest.raises(ValueError):
            parse_keys(bad)


async def test_api_validates_actions_and_answers_409_without_a_browser(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        await _no_browser(client)


async def _no_browser(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/sessions", json={"metadata": {"screen": "800x600"}})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    bad = await client.post(f"/v1/sessions/{sid}/computer",
                            json={"action": "left_click", "coordinate": [800, 1]})
    assert_problem(bad, 422, "validation_error")
    unknown = await client.post(f"/v1/sessions/{sid}/computer", json={"action": "key", "text": "ctrl+zz"})
    assert_problem(unknown, 422, "validation_error")
    nothing = await client.post(f"/v1/sessions/{sid}/computer", json={"action": "screenshot"})
    assert_problem(nothing, 409, "browser_unavailable")
    info = await client.get(f"/v1/sessions/{sid}/browser")
    assert_problem(info, 409, "browser_unavailable")
    other = await client.get("/v1/sessions/ses_nosuchsession/browser")
    assert other.status_code == 404

"""The one place the control plane catches node errors (capsa.control.nodes.calls) and the front-end hooks
the composition root fills (capsa.control.front_ends, capsa.frontends)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from capsa.control.errors import ApiError
from capsa.control.nodes.calls import NodeLost, attempt, node_call, node_error, quietly, until_lost
from capsa.control.nodes.client import NodeError
from capsa.control.request_gate import body_rules
from capsa.control.settings import ControlSettings
from capsa.frontends import MCP_PATH, e2b_front_end, mcp_front_end
from capsa.sdk.e2b import E2B_MOUNT_PATH


async def _fails(code: str, status: int, message: str = "no") -> None:
    raise NodeError(code, status, message)


async def _answers() -> str:
    return "yes"


@pytest.mark.parametrize(("code", "status", "answered"), [
    ("process_not_found", 404, 404), ("node_unreachable", 503, 503), ("odd", 302, 502),
    ("bad_node_answer", 502, 502),
])
def test_a_node_error_answers_with_its_code_and_status(code: str, status: int, answered: int) -> None:
    error = node_error(NodeError(code, status, "detail"), "session s could not be resumed")
    assert isinstance(error, ApiError)
    assert (error.code, error.status) == (code, answered)
    assert error.message == "session s could not be resumed: detail"
    assert node_error(NodeError(code, status, "detail")).message == "detail"


async def test_attempt_hands_the_node_error_back_and_lets_others_through() -> None:
    assert await attempt(_answers()) == "yes"
    failed = await attempt(_fails("x", 409))
    assert isinstance(failed, NodeError) and failed.code == "x"
    with pytest.raises(ApiError) as raised:
        await node_call(_fails("x", 409), "what")
    assert (raised.value.code, raised.value.status, raised.value.message) == ("x", 409, "what: no")


async def test_quietly_logs_a_failure_and_passes_the_codes_that_are_fine(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="capsa.control.nodes.calls"):
        assert await quietly(_answers(), "could not do it")
        assert await quietly(_fails("snapshot_not_found", 404), "could not do it",
                             fine=("snapshot_not_found",))
        assert not await quietly(_fails("node_unreachable", 503, "down"), "could not delete snapshot s1")
    assert [r.getMessage() for r in caplog.records] == ["could not delete snapshot s1: down"]


async def test_a_stream_ends_with_node_lost_when_the_node_goes_away() -> None:
    async def events() -> AsyncIterator[int]:
        yield 1
        raise NodeError("node_unreachable", 503, "gone")

    seen = [event async for event in until_lost(events())]
    assert seen == [1, NodeLost("gone", "NodeError")]


def test_front_ends_bring_their_own_gates_and_body_rules() -> None:
    settings = ControlSettings(database_url="sqlite+aiosqlite://")
    e2b, mcp = e2b_front_end(settings), mcp_front_end()
    assert e2b.gate is not None and e2b.gate.prefix == E2B_MOUNT_PATH and e2b.gate.check is not None
    assert mcp.gate is not None and mcp.gate.prefix == MCP_PATH and mcp.gate.check is None  # an API key
    alone = body_rules(settings)
    both = body_rules(settings, [e2b.gate, mcp.gate])
    assert len(both) == len(alone) + len(e2b.gate.rules) + len(mcp.gate.rules)
    assert both[:len(alone)] == alone

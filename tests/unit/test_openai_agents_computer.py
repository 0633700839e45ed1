"""The OpenAI Agents SDK adapter implements the whole ``agents.AsyncComputer`` interface (instantiable: no
abstract method left) and reports the browser environment and the screen it was given."""

from __future__ import annotations

from typing import Any, cast

from agents.computer import AsyncComputer

from capsa.integrations.openai_agents import CapsaComputer


class _Session:
    computer = object()


def test_adapter_is_a_complete_async_computer() -> None:
    computer = CapsaComputer(cast(Any, _Session()), width=1024, height=768)
    assert isinstance(computer, AsyncComputer)
    assert computer.environment == "browser" and computer.dimensions == (1024, 768)
    assert not getattr(CapsaComputer, "__abstractmethods__", set())

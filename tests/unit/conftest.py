"""Fixtures of the unit suite: the control plane and node stack with a fake runtime, on every database
(``db_url`` and ``pg_cluster`` are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image


@pytest.fixture
async def make_stack(db_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ApiStack]]]:
    """Factory: ``await make_stack(settings={...}, capacity=...)``; every stack is stopped afterwards."""
    stacks: list[ApiStack] = []

    async def factory(**kwargs: Any) -> ApiStack:
        runtime = FakeRuntime()
        stack = ApiStack(db_url, runtime, fake_image(tmp_path / "image"), **kwargs)
        stacks.append(stack)
        return await stack.start()

    try:
        yield factory
    finally:
        for s in stacks:
            await s.stop()


@pytest.fixture
async def stack(db_url: str, tmp_path: Path) -> AsyncIterator[ApiStack]:
    """A started stack with a fake runtime on ``db_url``."""
    runtime = FakeRuntime()
    async with ApiStack(db_url, runtime, fake_image(tmp_path / "image")) as s:
        yield s

"""Fixtures of the security suite."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image


@pytest.fixture
async def make_stack(db_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ApiStack]]]:
    """Factory: ``await make_stack(settings={...}, egress=...)`` (fake runtime); every stack is stopped
    afterwards. Modules that need another kind of stack define their own ``make_stack``."""
    stacks: list[ApiStack] = []

    async def factory(**kwargs: Any) -> ApiStack:
        stack = ApiStack(db_url, FakeRuntime(), fake_image(tmp_path / "image"), **kwargs)
        stacks.append(stack)
        return await stack.start()

    try:
        yield factory
    finally:
        for stack in stacks:
            await stack.stop()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ApiStack]:
    """One API stack (fake runtime) on a SQLite database; modules that need another define their own."""
    async with ApiStack(f"sqlite+aiosqlite:///{tmp_path}/capsa.db", FakeRuntime(),
                        fake_image(tmp_path / "image")) as s:
        yield s

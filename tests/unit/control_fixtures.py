"""Fixtures for the control plane API tests: the server stack over SQLite and over a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.postgres import PgCluster, postgres_missing_reason, temporary_postgres

__all__ = ["db_url", "make_stack", "pg_cluster", "stack"]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster | None]:
    reason = postgres_missing_reason()
    if reason is not None:
        print(f"PostgreSQL tests will be skipped: {reason}")
        yield None
        return
    with temporary_postgres() as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_cluster: PgCluster | None) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/capsa.db"
    if pg_cluster is None:
        pytest.skip(f"PostgreSQL 15 not available: {postgres_missing_reason()}")
    return pg_cluster.new_database()


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
    runtime = FakeRuntime()
    async with ApiStack(db_url, runtime, fake_image(tmp_path / "image")) as s:
        yield s

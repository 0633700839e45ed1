"""The control plane's database for tests: SQLite in a test's directory, or a fresh database on a throwaway
PostgreSQL 15 cluster shared by the whole session (the ``pg_cluster`` and ``db_url`` fixtures in
tests/conftest.py use these)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.postgres import PgCluster, postgres_missing_reason, temporary_postgres

__all__ = ["DATABASES", "database_url", "optional_postgres", "sqlite_url"]

DATABASES = ("sqlite", "postgresql")


def sqlite_url(directory: Path) -> str:
    return f"sqlite+aiosqlite:///{directory}/capsa.db"


@contextmanager
def optional_postgres() -> Iterator[PgCluster | None]:
    """A running cluster, or ``None`` (with the reason printed once) where PostgreSQL 15 is missing."""
    reason = postgres_missing_reason()
    if reason is not None:
        print(f"PostgreSQL tests will be skipped: {reason}")
        yield None
        return
    with temporary_postgres() as cluster:
        yield cluster


def database_url(kind: str, directory: Path, cluster: PgCluster | None) -> str:
    """The URL of an empty database of ``kind`` (one of :data:`DATABASES`); skips the calling test when
    PostgreSQL is asked for but missing."""
    if kind == "sqlite":
        return sqlite_url(directory)
    if kind != "postgresql":
        raise ValueError(f"unknown database kind {kind!r}")
    if cluster is None:
        pytest.skip(f"PostgreSQL 15 not available: {postgres_missing_reason()}")
    return cluster.new_database()

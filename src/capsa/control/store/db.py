"""Engine creation and Alembic migrations, run automatically when the control plane starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, event, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

__all__ = ["DbSession", "create_engine", "migrate", "session_factory", "sqlite_thread_engine"]

_MIGRATIONS = Path(__file__).with_name("migrations")
# Any constant works: it only has to be the same for every replica that might migrate at once.
_PG_MIGRATION_LOCK = 0x63617073


def _private_sqlite_file(url: str) -> None:
    """Create the SQLite file 0600 (or make an existing one 0600) before SQLite opens it: it holds sealed
    tokens, every session's environment, policies and the audit log. SQLite gives its -journal, -wal and
    -shm files the mode of the database file."""
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-journal", "-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists() and not side.is_symlink():
            side.chmod(0o600)


def create_engine(url: str, sqlite_synchronous: str = "normal") -> AsyncEngine:
    """The engine for ``url``. SQLite runs in WAL mode with ``PRAGMA synchronous=<sqlite_synchronous>``:
    ``normal`` (the default) syncs the log at checkpoints, not at every commit, so a commit survives the
    process crashing but the last ones may roll back if the machine loses power; ``full`` syncs every
    commit (on this kind of disk a few to over ten ms per commit)."""
    if sqlite_synchronous not in ("normal", "full"):
        raise ValueError(f"sqlite_synchronous must be normal or full, not {sqlite_synchronous!r}")
    if url.startswith("sqlite"):
        _private_sqlite_file(url)
        # Several replicas (or processes) may share one SQLite file: WAL lets readers proceed during a
        # write and the busy timeout makes writers queue instead of failing at once.
        engine = create_async_engine(url, connect_args={"timeout": 30})
        _sqlite_pragmas(engine.sync_engine, sqlite_synchronous)
        return engine
    return create_async_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(engine: Engine, sqlite_synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: object, _record: object) -> None:
        cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute(f"PRAGMA synchronous={sqlite_synchronous.upper()}")
        cursor.close()


def sqlite_thread_engine(engine: AsyncEngine, sqlite_synchronous: str = "normal") -> Engine | None:
    """A synchronous engine (the standard library's sqlite3) on the same SQLite file as ``engine``, for
    work that runs whole transactions in a thread of its own; None for other databases and in-memory
    SQLite.

    Why: aiosqlite runs each DBAPI call on its own thread and hands the result back to the event loop,
    so one small transaction of three statements costs about a dozen hand-offs between threads (cursor,
    execute, fetch, close for each statement, then commit and the pool's reset), each a wake-up of the
    other thread and of the event loop. The audit writer, the one steady writer, instead hands a whole
    batch to one thread in one hop. PostgreSQL's asyncpg has no such thread, so it keeps the async path."""
    url = engine.url
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:" \
            or url.database.startswith("file:"):
        return None
    sync = create_sync_engine(url.set(drivername="sqlite+pysqlite"), connect_args={"timeout": 30},
                              pool_size=1, max_overflow=0)
    _sqlite_pragmas(sync, sqlite_synchronous)
    return sync


def session_factory(engine: AsyncEngine) -> async_sessionmaker[DbSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def _upgrade(connection: Connection, node_token_sealer: Callable[[str, str], bytes] | None) -> None:
    if connection.dialect.name == "postgresql":
        # Transaction-scoped: released when the migration transaction ends.
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["connection"] = connection
    config.attributes["node_token_sealer"] = node_token_sealer
    command.upgrade(config, "head")


async def migrate(engine: AsyncEngine, node_token_sealer: Callable[[str, str], bytes] | None = None) -> None:
    """Bring the schema to the newest revision (idempotent; safe with several replicas).

    ``node_token_sealer(node_id, token)`` encrypts the node API tokens that older revisions kept in clear.
    """
    if engine.url.get_backend_name() == "sqlite" and engine.url.database:
        Path(engine.url.database).parent.mkdir(parents=True, exist_ok=True)
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, node_token_sealer)

"""Migration 0005: an existing node's current capacity becomes its limit (and what it reported), so an
upgrade neither frees nor strands capacity; the tables it adds exist."""

from __future__ import annotations

import json
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

import capsa.control.store
from capsa.control.store.db import create_engine, migrate


def _upgrade_to(connection: Connection, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(capsa.control.store.__file__).with_name("migrations")))
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def test_migration_0005_bounds_existing_nodes_by_their_capacity(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/old.db")
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade_to, "0004")
            await conn.execute(sa.text(
                "INSERT INTO nodes (id, url, memory_mib, vcpus, max_sandboxes, templates, used, egress, "
                "registered_at, last_heartbeat_at) VALUES ('old-node', 'unix:///x', 1024, 2, 3, "
                "'[\"base\"]', '{}', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:00')"))
        await migrate(engine)
        async with engine.connect() as conn:
            row = (await conn.execute(sa.text("SELECT * FROM nodes"))).mappings().one()
            tables = set((await conn.execute(sa.text(
                "SELECT name FROM sqlite_master WHERE type='table'"))).scalars())
    finally:
        await engine.dispose()
    expected = {"memory_mib": 1024, "vcpus": 2, "max_sandboxes": 3}
    assert json.loads(row["capacity_limit"]) == expected == json.loads(row["capacity_reported"])
    assert {"audit_cursors", "audit_dropped"} <= tables

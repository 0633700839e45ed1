"""``capsa control`` as a real process: ready line, /v1/health, clean exit on SIGTERM and SIGINT; and
migration 0004 sealing the node tokens that older revisions kept in clear."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

import capsa.control.store
from capsa.control.errors import ApiError
from capsa.control.keys import generate_key
from capsa.control.nodes.secrets import NodeSealer, node_sealer
from capsa.control.secretbox import SecretSealer
from capsa.control.server import control_settings
from capsa.control.store.db import create_engine, migrate

_CLI = "from capsa.cli.main import main; main()"
_READY = re.compile(r"capsa: control plane on (http://\S+)")


async def _start_control(state: Path, env: dict[str, str]) -> tuple[asyncio.subprocess.Process, str]:
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "control", "--host", "127.0.0.1", "--port", "0",
        "--state-dir", str(state), env={**os.environ, **env}, stdout=pipe, stderr=pipe)
    assert proc.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                err = (await proc.stderr.read()).decode() if proc.stderr else ""
                raise AssertionError(f"capsa control exited before it was ready: {lines} {err}")
            lines.append(line)
            if match := _READY.search(line):
                return proc, match.group(1)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_capsa_control_serves_and_stops_cleanly(tmp_path: Path, stop: signal.Signals) -> None:
    key = generate_key().full
    env = {"CAPSA_BOOTSTRAP_KEY": key, "CAPSA_DATABASE_URL": ""}
    proc, url = await _start_control(tmp_path / "state", env)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/v1/health")).status_code == 200
            nodes = await client.get("/v1/nodes", headers={"Authorization": f"Bearer {key}"})
            assert nodes.status_code == 200 and nodes.json() == {"items": []}
        assert (tmp_path / "state" / "capsa.db").exists()
        assert (tmp_path / "state" / "secret.key").stat().st_mode & 0o077 == 0
        started = time.monotonic()
        proc.send_signal(stop)
        async with asyncio.timeout(20):
            code = await proc.wait()
        assert code == 0, (await proc.stderr.read()).decode() if proc.stderr else ""
        assert time.monotonic() - started < 10
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_capsa_control_announces_a_generated_bootstrap_key(tmp_path: Path) -> None:
    pipe = asyncio.subprocess.PIPE
    env = {k: v for k, v in os.environ.items() if k not in ("CAPSA_BOOTSTRAP_KEY", "CAPSA_DATABASE_URL")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "control", "--port", "0", "--state-dir", str(tmp_path), env=env,
        stdout=pipe, stderr=pipe)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            first = (await proc.stdout.readline()).decode()
            ready = (await proc.stdout.readline()).decode()
        assert re.search(r"bootstrap admin key .*: csk_[0-9a-z]{12}_[0-9A-Za-z]{32}$", first.strip()), first
        assert _READY.search(ready), ready
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_capsa_control_refuses_a_malformed_bootstrap_key(tmp_path: Path) -> None:
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "control", "--port", "0", "--state-dir", str(tmp_path),
        env={**os.environ, "CAPSA_BOOTSTRAP_KEY": "nope"}, stdout=pipe, stderr=pipe)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode != 0 and out == b""
    assert len(err.decode().strip().splitlines()) == 1 and "CAPSA_BOOTSTRAP_KEY" in err.decode()


def _upgrade_to(connection: Connection, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(capsa.control.store.__file__).with_name("migrations")))
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def test_migration_0004_seals_existing_node_tokens(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/old.db")
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade_to, "0003")
            await conn.execute(sa.text(
                "INSERT INTO nodes (id, url, token, memory_mib, vcpus, max_sandboxes, templates, used, "
                "registered_at, last_heartbeat_at) VALUES ('old-node', 'unix:///x', "
                "'old-clear-token-123456', 1024, 2, 2, '[\"base\"]', '{}', '2026-01-01 00:00:00', "
                "'2026-01-01 00:00:00')"))
        sealer = NodeSealer(SecretSealer(os.urandom(32)))
        await migrate(engine, sealer.seal)
        async with engine.connect() as conn:
            row = (await conn.execute(sa.text("SELECT * FROM nodes"))).mappings().one()
    finally:
        await engine.dispose()
    assert "token" not in row
    assert b"old-clear-token-123456" not in row["token_sealed"]
    assert sealer.open("old-node", row["token_sealed"]) == "old-clear-token-123456"
    assert row["credential_hash"] and row["egress"]


def test_replicas_on_a_database_server_share_the_secret_key(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPSA_SECRET_KEY", raising=False)
    monkeypatch.delenv("CAPSA_SECRET_KEY_FILE", raising=False)
    monkeypatch.setenv("CAPSA_BOOTSTRAP_KEY", generate_key().full)
    shared = "postgresql+asyncpg://postgres@127.0.0.1:1/capsa"
    one = node_sealer(control_settings(tmp_path / "one", shared))
    two = node_sealer(control_settings(tmp_path / "two", shared))
    assert one is not None and two is not None
    assert two.open("node_x", one.seal("node_x", "api-token")) == "api-token"
    assert not (tmp_path / "one" / "secret.key").exists()
    # With SQLite the key is a file in the state dir, as for `capsa serve`.
    local = control_settings(tmp_path / "local", None)
    assert local.secret_key_file == tmp_path / "local" / "secret.key" and local.secret_key_file.exists()
    monkeypatch.setenv("CAPSA_BOOTSTRAP_KEY", generate_key().full)
    other = node_sealer(control_settings(tmp_path / "three", shared))
    assert other is not None
    with pytest.raises(ApiError, match="node_x"):
        other.open("node_x", one.seal("node_x", "api-token"))

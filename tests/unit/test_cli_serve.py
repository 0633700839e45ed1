"""``capsa serve`` argument handling: bad addresses fail in one line before anything is created, and the
options reach ``capsa.serve.run``. The real server is exercised in tests/integration/test_cli_serve.py."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import capsa.serve
from capsa.cli.main import cli
from tests.support.vm import searchable_dir


def test_port_in_use_fails_before_creating_state(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--port", str(port), "--state-dir", str(state)])
    assert result.exit_code == 1
    assert result.stderr == f"error: cannot serve on 127.0.0.1:{port}: Address already in use\n"
    assert not state.exists()


def test_unresolvable_host_fails_cleanly(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "no-such-host.invalid", "--state-dir",
                                      str(tmp_path / "s")])
    assert result.exit_code == 1 and result.stderr.startswith("error: cannot serve on no-such-host.invalid")
    assert "Traceback" not in result.output


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every uid can search (a pytest tmp_path sits under a 0700 directory)."""
    with searchable_dir("capsa-cli-", parent="/var/tmp") as path:
        yield path


def test_options_reach_the_server(open_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    async def fake_run(host: str, port: int, state_dir: Path, database_url: str | None, accel: str) -> None:
        calls.append((host, port, state_dir, database_url, accel))

    monkeypatch.setattr(capsa.serve, "run", fake_run)
    state = open_dir / "state"
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(state), "--accel", "tcg",
                                      "--database-url", "sqlite+aiosqlite:////x.db", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [("127.0.0.1", 0, state.resolve(), "sqlite+aiosqlite:////x.db", "tcg")]
    assert '"accel": "tcg"' in result.stderr


def test_unreachable_state_dir_is_refused_in_one_line(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    async def fake_run(*args: Any) -> None:
        calls.append(args)

    monkeypatch.setattr(capsa.serve, "run", fake_run)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # VMs run as other uids (as under root)
    tmp_path.chmod(0o700)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")])
    assert result.exit_code != 0
    assert calls == []  # refused before anything starts
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{tmp_path} (mode 0700) is not searchable by the sandboxes' VM users" in lines[0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_cancels_the_server_and_its_cleanup_runs(open_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             signum: signal.Signals) -> None:
    events: list[str] = []

    async def served(*args: Any) -> None:
        try:
            os.kill(os.getpid(), signum)
            await asyncio.sleep(30)
            events.append("not cancelled")
        finally:
            await asyncio.sleep(0)  # cleanup may await
            events.append("cleaned up")

    monkeypatch.setattr(capsa.serve, "run", served)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(open_dir / "state")])
    assert result.exit_code == 0, result.output
    assert events == ["cleaned up"]
    assert "Traceback" not in result.output

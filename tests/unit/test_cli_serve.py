"""``capsa serve`` argument handling: bad addresses fail in one line before anything is created, and the
options reach ``capsa.serve.run``. The real server is exercised in tests/integration/test_cli_serve.py."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import capsa.serve
from capsa.cli.main import cli


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


def test_options_reach_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    async def fake_run(host: str, port: int, state_dir: Path, database_url: str | None, accel: str) -> None:
        calls.append((host, port, state_dir, database_url, accel))

    monkeypatch.setattr(capsa.serve, "run", fake_run)
    tmp_path.chmod(0o755)
    state = tmp_path / "state"
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(state), "--accel", "tcg",
                                      "--database-url", "sqlite+aiosqlite:////x.db", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [("127.0.0.1", 0, state.resolve(), "sqlite+aiosqlite:////x.db", "tcg")]
    assert '"accel": "tcg"' in result.stderr


def test_unreachable_state_dir_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_run(*args: Any) -> None:
        return None

    monkeypatch.setattr(capsa.serve, "run", fake_run)
    tmp_path.chmod(0o700)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 0
    assert f"warning: {tmp_path} is not searchable by other users" in result.stderr


def test_interrupt_exits_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(capsa.serve, "run", interrupted)
    tmp_path.chmod(0o755)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 0
    assert "Traceback" not in result.output and "error" not in result.stderr

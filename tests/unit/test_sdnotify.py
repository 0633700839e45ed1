"""systemd's readiness protocol, received on a real unix datagram socket as ``NOTIFY_SOCKET``: the writer
itself, and ``capsa control`` as a process (READY=1 once its API answers, STOPPING=1 on SIGTERM). The node's
notifications are covered with a real node in tests/integration/test_node_notify.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from capsa.common.sdnotify import notify
from capsa.control.keys import generate_key
from tests.support.served import ROOT, free_port


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """What systemd listens on: a unix datagram socket, and its path for NOTIFY_SOCKET."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        yield sock, path


def test_notify_sends_one_datagram_to_the_socket_systemd_names(listener: tuple[socket.socket, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = listener
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False  # not under systemd: nothing is sent, nothing fails
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("READY=1", "STATUS=serving") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    # An abstract socket (systemd's own form, "@name").
    name = f"capsa-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as abstract:
        abstract.bind("\0" + name)
        abstract.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1") is True
        assert abstract.recv(4096) == b"STOPPING=1"
    # Nobody listening: the service goes on, told nothing.
    monkeypatch.setenv("NOTIFY_SOCKET", path + ".gone")
    assert notify("READY=1") is False


def test_capsa_control_notifies_ready_once_it_serves_and_stopping_on_sigterm(
        tmp_path: Path, listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": path, "CAPSA_BOOTSTRAP_KEY": generate_key().full,
           "CAPSA_DATABASE_URL": ""}
    argv = [sys.executable, "-c", "from capsa.cli.main import main; main()", "control", "--host", "127.0.0.1",
            "--port", str(port), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = sock.recv(4096).decode()
        assert ready.split("\n") == ["READY=1", f"STATUS=serving on http://127.0.0.1:{port}"]
        # READY=1 means serving: the API answers at once, no retry.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        sock.recv(4096)  # nothing more

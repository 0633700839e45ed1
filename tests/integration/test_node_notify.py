"""``capsa node`` under a systemd notify unit, as a real process on a real unix datagram socket
(``NOTIFY_SOCKET``): READY=1 only once it is registered (the control plane lists it healthy at that moment),
STOPPING=1 when SIGTERM arrives, a clean exit and nothing of it left on the host. Its host checks
(``capsa doctor``'s) run first and pass here."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.control.keys import generate_key
from tests.support.fleet import enrol_token, listed_nodes, start_control, start_node
from tests.support.leftovers import wait_no_node_leftovers
from tests.support.served import serve_workdir

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(900)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-notify-") as path:
        yield path


def test_capsa_node_notifies_ready_once_registered_and_stopping_on_sigterm(workdir: Path) -> None:
    key = generate_key().full
    control = start_control(workdir, "", key)  # SQLite: one replica is all this needs
    node = None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(workdir / "notify.sock"))
        sock.settimeout(120)
        try:
            token = enrol_token(control.url, key)
            node, node_id = start_node(workdir, "node-a", control.url, token,
                                       env={"NOTIFY_SOCKET": str(workdir / "notify.sock")})
            ready = sock.recv(4096).decode().split("\n")
            assert ready == ["READY=1", f"STATUS=node {node_id} serving on {node.url}"]
            assert listed_nodes(control.url, key)[node_id]["healthy"] is True
            assert node.stop(signal.SIGTERM, timeout=180) == 0, node.errors()
            assert sock.recv(4096) == b"STOPPING=1\nSTATUS=pausing sessions and removing VMs"
            assert wait_no_node_leftovers(node.state_dir) == []
        finally:
            if node is not None:
                node.stop()
            control.stop(signal.SIGTERM)

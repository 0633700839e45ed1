"""Issue 27 H1 against a real ``capsa serve`` process: four concurrent unauthenticated 300 MiB bodies (to
``/v1/sessions`` declared and chunked, ``/v1/nodes/enrol``, an E2B route) are answered without being read,
and the process's resident memory stays flat (the review measured +3.4 GiB before the fix).

Raw sockets: each attacker writes its body as fast as the server takes it while it waits for the answer,
so what it managed to send is what the server read (plus the kernel's socket buffers).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.served import Served, serve_workdir, start_serve

# `capsa serve` restores its base template and runs its node in the process under test.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]

MIB = 1 << 20
ATTACK = 300 * MIB
BLOCK = b"x" * (64 * 1024)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_workdir() as work:
        key = "csk_bodiesbodies_" + "b" * 32
        server = start_serve(work / "state", work, env={"CAPSA_BOOTSTRAP_KEY": key})
        try:
            yield server
        finally:
            server.stop()


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _attack(port: int, method: str, path: str, chunked: bool) -> tuple[int, str, int]:
    """Send a 300 MiB body with no credential; returns the answer's status and code, and how many body
    bytes were written before it came (a thread writes while this one waits for the answer)."""
    sock = socket.create_connection(("127.0.0.1", port))
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {ATTACK}"
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"{framing}\r\n\r\n".encode())
    frame = b"%x\r\n%s\r\n" % (len(BLOCK), BLOCK) if chunked else BLOCK
    sent = 0

    def pump() -> None:
        nonlocal sent
        with contextlib.suppress(OSError):  # the server answered and closed the connection
            while sent < ATTACK:
                sock.sendall(frame)
                sent += len(BLOCK)
            if chunked:
                sock.sendall(b"0\r\n\r\n")

    writer = threading.Thread(target=pump, daemon=True)
    writer.start()
    try:
        received = b""
        while b"\r\n\r\n" not in received and (chunk := sock.recv(65536)):
            received += chunk
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        fields = dict(line.lower().split(":", 1) for line in lines[1:])
        length = int(fields["content-length"])
        while len(rest) < length and (chunk := sock.recv(65536)):
            rest += chunk
        answered_after = sent
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        writer.join()
    return int(lines[0].split()[1]), str(json.loads(rest[:length]).get("code")), answered_after


def test_four_concurrent_300_mib_unauthenticated_bodies_leave_serve_flat(served: Served) -> None:
    pid = served.proc.pid
    port = int(served.url.rsplit(":", 1)[1])
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from the current RSS
    before = _status(pid)

    targets = [("/v1/sessions", False), ("/v1/sessions", True), ("/v1/nodes/enrol", True),
               ("/e2b/sandboxes", True)]
    with ThreadPoolExecutor(len(targets)) as pool:
        answers = list(pool.map(lambda t: _attack(port, "POST", t[0], chunked=t[1]), targets))
    after = _status(pid)
    grown = after["VmHWM"] - before["VmRSS"]
    print(f"capsa serve RSS before {before['VmRSS'] / MIB:.1f} MiB, peak during the attack "
          f"{after['VmHWM'] / MIB:.1f} MiB (+{grown / MIB:.1f} MiB), after {after['VmRSS'] / MIB:.1f} MiB; "
          f"body bytes each attacker got out: {[sent // MIB for _, _, sent in answers]} MiB")
    assert [(status, code) for status, code, _ in answers] == [
        (413, "payload_too_large"), (401, "unauthorized"), (401, "enrol_token_invalid"),
        (401, "unauthorized")]
    assert all(sent < 32 * MIB for _, _, sent in answers), answers
    assert grown < 64 * MIB

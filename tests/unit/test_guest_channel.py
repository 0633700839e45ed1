"""Malformed frames in both directions, lost connections and flow control on the guest channel.

Host -> guest: raw bytes sent to the real daemon. Guest -> host: a fake guest (a Unix socket server
in the test) that answers the real GuestClient with garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import struct
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from capsa.guest.protocol import INITIAL_WINDOW, MAGIC, PROTOCOL_VERSION, Decoder, Frame, Kind, encode_frame
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import ChannelClosed, GuestError
from capsa.node.guestlink.streams import GuestDeadlines
from capsa.node.statuses import status_of
from tests.support.local_guest import GUEST_PACKAGE, LocalGuest, guest_client, local_guest
from tests.support.processes import processes_with

__all__ = ["guest_client", "local_guest"]


def raw_header(kind: int, stream: int, meta_len: int, data_len: int,
               version: int = PROTOCOL_VERSION) -> bytes:
    prefix = struct.pack(">4sBBHIII", MAGIC, version, kind, 0, stream, meta_len, data_len)
    return prefix + struct.pack(">I", zlib.crc32(prefix))


class RawPeer:
    """A blocking socket speaking frames by hand (to send what GuestClient never would)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(str(path))
        self.decoder = Decoder()
        self.pending: list[Frame] = []

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def frame(self) -> Frame:
        while not self.pending:
            chunk = self.sock.recv(65536)
            assert chunk, "daemon closed the connection"
            self.pending += self.decoder.feed(chunk)
        return self.pending.pop(0)

    def until(self, stream: int, kinds: tuple[Kind, ...] = (Kind.RESULT, Kind.ERROR)) -> Frame:
        while True:
            f = self.frame()
            if f.stream == stream and f.kind in kinds:
                return f

    def close(self) -> None:
        self.sock.close()


async def in_thread(fn: Callable[[], Frame]) -> Frame:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def test_daemon_reports_garbage_and_keeps_serving(local_guest: LocalGuest) -> None:
    peer = RawPeer(local_guest.socket_path)
    try:
        peer.send(b"\x00\x01garbage without any frame" * 20 + encode_frame(Kind.REQUEST, 1, {"op": "health"}))
        err = await in_thread(lambda: peer.until(0, (Kind.ERROR,)))
        assert err.code == "malformed_frame"
        ok = await in_thread(lambda: peer.until(1))
        assert ok.kind == Kind.RESULT and ok.meta["status"] == "ok"

        cases = [
            (raw_header(Kind.DATA, 7, 0, 50 * 1024 * 1024), 7, "frame_too_large"),
            (raw_header(Kind.REQUEST, 9, 5, 0) + b"{bad}", 9, "malformed_frame"),
            (raw_header(Kind.REQUEST, 10, 2, 0, version=9) + b"{}", 10, "unsupported_version"),
            (raw_header(99, 11, 2, 0) + b"{}", 11, "malformed_frame"),
            (encode_frame(Kind.REQUEST, 12, {"no_op": 1}), 12, "bad_request"),
            (encode_frame(Kind.REQUEST, 13, {"op": "nope"}), 13, "unknown_op"),
            (encode_frame(Kind.REQUEST, 0, {"op": "health"}), 0, "bad_request"),
            (encode_frame(Kind.REQUEST, 14, {"op": "exec", "cmd": {"x": 1}}), 14, "bad_request"),
        ]
        for raw, stream, code in cases:
            peer.send(raw)
            f = await in_thread(lambda s=stream: peer.until(s, (Kind.ERROR,)))  # type: ignore[misc]
            assert f.code == code, (stream, f.meta)
        # Random junk interleaved with real requests: every request is still answered.
        rng = random.Random(1234)
        for i in range(100, 130):
            peer.send(rng.randbytes(rng.randrange(1, 3000)))
            peer.send(encode_frame(Kind.REQUEST, i, {"op": "health"}))
            answer = await in_thread(lambda s=i: peer.until(s))  # type: ignore[misc]
            assert answer.kind in (Kind.RESULT, Kind.ERROR)
    finally:
        peer.close()
    client = await local_guest.client()
    assert (await client.health())["status"] == "ok"


async def test_daemon_refuses_data_beyond_the_window(local_guest: LocalGuest, tmp_path: Path) -> None:
    peer = RawPeer(local_guest.socket_path)
    try:
        peer.send(encode_frame(Kind.REQUEST, 5, {"op": "exec", "cmd": "sleep 5", "stdin": True}))
        chunk = b"x" * 65536
        for _ in range(INITIAL_WINDOW // len(chunk) + 2):  # more than the credit granted
            peer.send(encode_frame(Kind.DATA, 5, None, chunk))
        f = await in_thread(lambda: peer.until(5, (Kind.ERROR,)))
        assert f.code == "flow_control"
    finally:
        peer.close()


async def test_daemon_survives_a_host_that_vanishes_mid_frame(local_guest: LocalGuest) -> None:
    peer = RawPeer(local_guest.socket_path)
    peer.send(encode_frame(Kind.REQUEST, 3, {"op": "exec", "cmd": "cat", "stdin": True}))
    peer.send(encode_frame(Kind.DATA, 3, None, b"y" * 1000)[:500])
    peer.close()
    client = await local_guest.client()
    assert (await client.exec("echo fine")).stdout == b"fine\n"


# -- a fake guest that misbehaves towards the real client ------------------------------------------

Behaviour = Callable[[Frame, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def fake_guest(tmp_path: Path) -> AsyncIterator[Callable[[Behaviour], Awaitable[GuestClient]]]:
    servers: list[asyncio.Server] = []
    clients: list[GuestClient] = []

    async def start(behaviour: Behaviour) -> GuestClient:
        path = tmp_path / f"fake{len(servers)}.sock"

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = Decoder()
            try:
                while chunk := await reader.read(65536):
                    for frame in decoder.feed(chunk):
                        if frame.kind == Kind.REQUEST:
                            await behaviour(frame, writer)
                            if writer.is_closing():
                                return
            except (ConnectionError, OSError):
                pass

        servers.append(await asyncio.start_unix_server(handle, str(path)))
        client = await GuestClient.connect_unix(path)
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        s.close()
        await s.wait_closed()


async def _answer_health(frame: Frame, writer: asyncio.StreamWriter) -> None:
    writer.write(encode_frame(Kind.RESULT, frame.stream, {"status": "ok"}))
    await writer.drain()


async def test_client_turns_guest_garbage_into_errors(
        fake_guest: Callable[[Behaviour], Awaitable[GuestClient]]) -> None:
    calls = 0

    async def behaviour(frame: Frame, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            writer.write(os.urandom(5000).replace(MAGIC, b"XXXX"))
        else:
            await _answer_health(frame, writer)
        await writer.drain()

    client = await fake_guest(behaviour)
    with pytest.raises(GuestError) as e:
        await asyncio.wait_for(client.health(timeout=30), 60)  # the guard only catches a hang
    assert e.value.code == "protocol_error"
    assert client.protocol_errors >= 1
    assert (await client.health())["status"] == "ok"  # the channel itself stays usable


@pytest.mark.parametrize("reply, code", [
    (lambda s: raw_header(Kind.RESULT, s, 6, 0) + b"{nope}", "malformed_frame"),
    (lambda s: raw_header(Kind.RESULT, s, 2, 0, version=7) + b"{}", "unsupported_version"),
    (lambda s: raw_header(Kind.DATA, s, 0, 1 << 30), "frame_too_large"),
    (lambda s: raw_header(42, s, 2, 0) + b"{}", "malformed_frame"),
    (lambda s: encode_frame(Kind.ERROR, s, {"code": "not_found", "message": "m"}), "not_found"),
], ids=["bad-json", "bad-version", "oversize", "bad-kind", "plain-error"])
async def test_client_fails_the_call_on_a_malformed_reply(
        fake_guest: Callable[[Behaviour], Awaitable[GuestClient]], reply: Callable[[int], bytes],
        code: str) -> None:
    async def behaviour(frame: Frame, writer: asyncio.StreamWriter) -> None:
        writer.write(reply(frame.stream))
        await writer.drain()

    client = await fake_guest(behaviour)
    with pytest.raises(GuestError) as e:
        await asyncio.wait_for(client.read_file("/x"), 60)
    assert e.value.code == code


async def test_client_refuses_data_beyond_the_window(
        fake_guest: Callable[[Behaviour], Awaitable[GuestClient]]) -> None:
    async def flood(frame: Frame, writer: asyncio.StreamWriter) -> None:
        for _ in range(2 * INITIAL_WINDOW // 65536):  # ignores the credit it was given
            writer.write(encode_frame(Kind.DATA, frame.stream, {"ch": "stdout"}, b"z" * 65536))
        await writer.drain()

    async def stall(chunk: bytes) -> None:
        await asyncio.sleep(0.5)  # a slow consumer: the client grants no credit meanwhile

    client = await fake_guest(flood)
    with pytest.raises(GuestError) as e:
        await asyncio.wait_for(client.exec("x", on_stdout=stall), 60)
    assert e.value.code == "flow_control"


async def test_lost_connection_fails_every_pending_call_at_once(
        fake_guest: Callable[[Behaviour], Awaitable[GuestClient]]) -> None:
    seen = 0
    writers: list[asyncio.StreamWriter] = []

    async def behaviour(frame: Frame, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        writers.append(writer)
        if seen == 3:
            writer.close()  # the "VM" dies with three requests in flight

    client = await fake_guest(behaviour)
    results = await asyncio.wait_for(asyncio.gather(
        client.exec("sleep 100"), client.read_file("/a"), client.stream_process(1),
        return_exceptions=True), 60)
    assert all(isinstance(r, ChannelClosed) for r in results), results
    assert client.closed
    with pytest.raises(ChannelClosed):
        await client.health()


async def test_real_daemon_exit_fails_pending_calls(local_guest: LocalGuest) -> None:
    marker = f"capsa-orphan-{uuid.uuid4().hex}"
    client = await local_guest.client()
    pending = asyncio.create_task(client.exec(["sh", "-c", f"sleep 300; : {marker}"]))
    await asyncio.sleep(0.3)
    assert local_guest.process is not None
    local_guest.process.kill()
    try:
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(pending, 60)
        with pytest.raises(ChannelClosed):
            await client.list_processes()
    finally:
        # A SIGKILLed daemon cannot clean up: its command (in its own session) is orphaned. The
        # fake runtime confines daemons to a PID namespace for that reason; here the test cleans up.
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


async def test_calls_after_close_fail_fast(guest_client: GuestClient) -> None:
    await guest_client.close()
    with pytest.raises(ChannelClosed):
        await guest_client.exec("true")


async def test_health_timeout_on_a_silent_guest(fake_guest: Callable[[Behaviour], Awaitable[GuestClient]]
                                                ) -> None:
    async def silent(frame: Frame, writer: asyncio.StreamWriter) -> None:
        return None

    client = await fake_guest(silent)
    with pytest.raises(GuestError) as e:
        await client.health(timeout=0.2)
    assert e.value.code == "guest_timeout"
    assert status_of(e.value) == 504
    with pytest.raises(GuestError) as e:
        await client.wait_ready(timeout=0.5, interval=0.1)
    assert e.value.code == "guest_timeout"


async def test_daemon_serves_an_inherited_descriptor_until_eof() -> None:
    ours, theirs = socket.socketpair()
    src = GUEST_PACKAGE.parents[1]  # src/, where capsa is a namespace package
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable,
        "-m", "capsa.guest", "--fd", str(theirs.fileno()), "--no-clock",
        pass_fds=(theirs.fileno(),), env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    theirs.close()
    try:
        reader, writer = await asyncio.open_connection(sock=ours)
        client = GuestClient(reader, writer)
        assert (await client.exec(["echo", "over-fd"])).stdout == b"over-fd\n"
        await client.close()  # EOF on the descriptor ends the daemon cleanly
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_exec_gives_up_on_a_guest_that_ignores_its_timeout(
        fake_guest: Callable[[Behaviour], Awaitable[GuestClient]]) -> None:
    seen: list[Frame] = []

    async def silent(frame: Frame, writer: asyncio.StreamWriter) -> None:
        if frame.meta["op"] == "health":
            await _answer_health(frame, writer)  # alive, but never reports the command
        else:
            seen.append(frame)

    client = await fake_guest(silent)
    client.deadlines = GuestDeadlines(exec_grace=0.2)
    with pytest.raises(GuestError) as e:
        await client.exec("sleep 100", timeout=0.1)
    assert e.value.code == "guest_timeout"
    assert "within its timeout" in e.value.message
    assert seen[0].meta["timeout"] == 0.1  # the guest was asked to enforce it

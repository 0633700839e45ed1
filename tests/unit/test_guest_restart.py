"""A guest daemon that dies and is restarted by PID 1: the client side against a fake daemon peer on a
socketpair (it can 'restart' without closing the connection, as a virtio-serial port behaves under QEMU),
and the real daemon's side of the handshake (hello, instance in health, requests for a dead instance
refused unrun)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from capsa.guest.protocol import HELLO_EVENT, INSTANCE_KEY, UNAVAILABLE, Decoder, Frame, Kind, encode_frame
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError, GuestUnavailable
from capsa.node.statuses import status_of
from tests.support.local_guest import LocalGuest, local_guest

__all__ = ["local_guest"]


class RawPeer:
    """A blocking host end speaking frames by hand to the real daemon (to send what GuestClient would not)."""

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

    def until(self, stream: int) -> Frame:
        while True:
            f = self.frame()
            if f.stream == stream and f.kind in (Kind.RESULT, Kind.ERROR):
                return f

    def close(self) -> None:
        self.sock.close()


async def in_thread(fn: Callable[[], Frame]) -> Frame:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


class FakeDaemon:
    """The guest end of a socketpair, speaking frames by hand. ``instance`` is who it claims to be;
    ``restart()`` announces a new instance on the same connection, as a daemon PID 1 restarted does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.pending: list[Frame] = []
        self.instance = ""

    async def hello(self, instance: str, client: GuestClient | None = None) -> None:
        """Announce ``instance``; with ``client``, wait until that client has heard it."""
        self.instance = instance
        await self.send(encode_frame(Kind.EVENT, 0, {"event": HELLO_EVENT, INSTANCE_KEY: instance,
                                                     "protocol": 1, "pid": 4242}))
        if client is not None:
            for _ in range(500):  # the client's reader task routes the hello
                if client.instance == instance:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"the client never heard the hello of {instance!r}")

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def request(self) -> Frame:
        while True:
            while not self.pending:
                chunk = await asyncio.wait_for(self.reader.read(65536), 10)
                assert chunk, "client closed the connection"
                self.pending += self.decoder.feed(chunk)
            frame = self.pending.pop(0)
            if frame.kind == Kind.REQUEST:
                return frame

    async def serve_exec(self, frame: Frame, output: bytes) -> None:
        """Answer an exec the way the real daemon does, unless it was meant for another instance."""
        wanted = frame.meta.get(INSTANCE_KEY)
        if wanted is not None and wanted != self.instance:
            await self.send(encode_frame(Kind.ERROR, frame.stream, {
                "code": UNAVAILABLE, "message": "not me", INSTANCE_KEY: self.instance}))
            return
        await self.send(encode_frame(Kind.EVENT, frame.stream, {"started": True, "pid": 7}))
        await self.send(encode_frame(Kind.DATA, frame.stream, {"ch": "stdout"}, output))
        await self.send(encode_frame(Kind.RESULT, frame.stream, {
            "exit_code": 0, "signal": None, "timed_out": False, "oom_killed": False}))


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[GuestClient, FakeDaemon]]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=host_sock)
    client = GuestClient(reader, writer)
    g_reader, g_writer = await asyncio.open_connection(sock=guest_sock)
    daemon = FakeDaemon(g_reader, g_writer)
    try:
        yield client, daemon
    finally:
        await client.close()
        g_writer.close()
        with contextlib.suppress(OSError):
            await g_writer.wait_closed()


async def test_a_restarted_daemon_fails_the_call_in_flight_at_once_and_the_next_call_works() -> None:
    async with pair() as (client, daemon):
        await daemon.hello("first", client)
        # Requests name the instance once the client has heard of it.
        first = asyncio.create_task(client.exec("kill -9 -1", timeout=60))
        request = await daemon.request()
        assert request.meta["op"] == "exec"
        assert request.meta[INSTANCE_KEY] == "first"
        assert client.instance == "first"
        await daemon.send(encode_frame(Kind.EVENT, request.stream, {"started": True, "pid": 7}))
        await asyncio.sleep(0.2)
        assert not first.done()  # the daemon 'died' silently: the connection stays open

        started = time.monotonic()
        await daemon.hello("second")
        with pytest.raises(GuestUnavailable) as failure:
            await asyncio.wait_for(first, 5)
        assert time.monotonic() - started < 2.0
        assert failure.value.code == "guest_unavailable"
        assert status_of(failure.value) == 503
        assert not client.closed
        assert client.instance == "second" and client.daemon_restarts == 1

        again = asyncio.create_task(client.exec(["echo", "hi"], timeout=60))
        request = await daemon.request()
        assert request.meta[INSTANCE_KEY] == "second"
        await daemon.serve_exec(request, b"hi\n")
        result = await asyncio.wait_for(again, 5)
        assert result.exit_code == 0 and result.stdout == b"hi\n" and result.oom_killed is False


async def test_a_refusal_from_a_new_instance_fails_every_call_meant_for_the_old_one() -> None:
    """The hello can be lost (e.g. swallowed by a frame the dead daemon left half written): the first
    request the new instance refuses tells the client just as well."""
    async with pair() as (client, daemon):
        await daemon.hello("old", client)
        calls = [asyncio.create_task(client.exec(f"echo {i}", timeout=60)) for i in range(3)]
        requests = [await daemon.request() for _ in calls]
        daemon.instance = "new"  # restarted without a hello reaching the client
        await daemon.serve_exec(requests[0], b"")
        for call in calls:
            with pytest.raises(GuestUnavailable):
                await asyncio.wait_for(call, 5)
        assert client.instance == "new"
        after = asyncio.create_task(client.exec("echo ok", timeout=60))
        await daemon.serve_exec(await daemon.request(), b"ok\n")
        assert (await asyncio.wait_for(after, 5)).stdout == b"ok\n"


async def test_the_same_instance_saying_hello_again_changes_nothing() -> None:
    async with pair() as (client, daemon):
        await daemon.hello("same", client)
        call = asyncio.create_task(client.exec("echo x", timeout=60))
        request = await daemon.request()
        await daemon.hello("same")  # e.g. the host side of the port reconnected
        await daemon.serve_exec(request, b"x\n")
        assert (await asyncio.wait_for(call, 5)).stdout == b"x\n"
        assert client.daemon_restarts == 0


async def test_real_daemon_announces_itself_and_refuses_requests_for_another_instance(
        local_guest: LocalGuest, tmp_path: Path) -> None:
    peer = RawPeer(local_guest.socket_path)
    try:
        hello = await in_thread(peer.frame)
        assert hello.kind == Kind.EVENT and hello.stream == 0 and hello.meta["event"] == HELLO_EVENT
        instance = hello.meta[INSTANCE_KEY]
        assert isinstance(instance, str) and len(instance) >= 16
        assert hello.meta["pid"] == local_guest.pid

        marker = tmp_path / "ran"
        peer.send(encode_frame(Kind.REQUEST, 5, {"op": "exec", "cmd": f"touch {marker}",
                                                 INSTANCE_KEY: "an-instance-that-died"}))
        refused = await in_thread(lambda: peer.until(5))
        assert refused.kind == Kind.ERROR and refused.code == UNAVAILABLE
        assert refused.meta[INSTANCE_KEY] == instance
        peer.send(encode_frame(Kind.REQUEST, 6, {"op": "health", INSTANCE_KEY: instance}))
        health = await in_thread(lambda: peer.until(6))
        assert health.kind == Kind.RESULT and health.meta[INSTANCE_KEY] == instance
        await asyncio.sleep(0.3)
        assert not marker.exists()  # the refused request never ran
    finally:
        peer.close()

    client = await local_guest.client()
    answer = await client.health()
    assert client.instance == answer[INSTANCE_KEY] == instance
    result = await client.exec("echo fine", timeout=30)
    assert result.stdout == b"fine\n" and result.oom_killed is False  # no cgroup of its own on a host


async def test_guest_unavailable_is_a_503_guest_error() -> None:
    err = GuestUnavailable("gone")
    assert isinstance(err, GuestError)
    assert (err.code, status_of(err), err.message) == ("guest_unavailable", 503, "gone")

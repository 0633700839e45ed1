"""A hostile guest (its root is the tenant's) against the node's guest client, on a socketpair: a guest
that streams without end for one call gets the call failed with ``protocol_error`` at the call's cap,
with the node's memory flat (tracemalloc peak below a stated bound); a guest that goes silent gets every
call failed at its deadline with ``guest_timeout`` instead of holding the caller forever. The peer speaks
frames by hand and honours the credit window, as a guest that wants to hurt the node without tripping
flow control would."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from capsa.guest import files as guest_files
from capsa.guest.background import RingBuffer
from capsa.guest.channel import Stream
from capsa.guest.errors import OpError
from capsa.guest.protocol import (
    INITIAL_WINDOW,
    MAX_LISTING_BYTES,
    PROCESS_OUTPUT_KEPT,
    Decoder,
    Frame,
    Kind,
    encode_frame,
)
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError, GuestTimeout
from capsa.node.guestlink.streams import MAX_EVENTS_PER_CALL, GuestDeadlines
from capsa.node.statuses import status_of

MIB = 1024 * 1024
CHUNK = b"x" * 65536
SHORT = GuestDeadlines(call=0.3, long_call=0.3, idle=0.3, exec_grace=0.3, probe_interval=0.3, probe=0.3)


class HostileGuest:
    """The guest end of the socketpair. It records requests, credit and cancels as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.requests: asyncio.Queue[Frame] = asyncio.Queue()
        self.credit: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self.changed = asyncio.Event()
        self.answer_health = False
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        decoder = Decoder()
        while chunk := await self.reader.read(65536):
            for frame in decoder.feed(chunk):
                if frame.kind == Kind.WINDOW:
                    self.credit[frame.stream] = self.credit.get(frame.stream, 0) + int(frame.meta["n"])
                elif frame.kind == Kind.CANCEL:
                    self.cancelled.add(frame.stream)
                elif frame.kind == Kind.REQUEST and frame.meta["op"] == "health" and self.answer_health:
                    await self.send(Kind.RESULT, frame.stream, {"status": "ok"})
                    continue
                elif frame.kind == Kind.REQUEST:
                    self.credit[frame.stream] = INITIAL_WINDOW
                    self.requests.put_nowait(frame)
                self.changed.set()

    async def send(self, kind: Kind, stream: int, meta: dict[str, Any] | None = None,
                   data: bytes = b"") -> None:
        self.writer.write(encode_frame(kind, stream, meta, data))
        await self.writer.drain()

    async def request(self, op: str) -> Frame:
        frame = await asyncio.wait_for(self.requests.get(), 10)
        assert frame.meta["op"] == op, frame.meta
        return frame

    async def flood(self, stream: int, total: int, meta: dict[str, Any] | None = None) -> int:
        """Send up to ``total`` bytes of DATA within the credit the client grants; stop at its CANCEL
        (or when it grants nothing more for 5 s). Returns the bytes sent."""
        sent = 0
        while sent < total and stream not in self.cancelled:
            if self.credit.get(stream, 0) < len(CHUNK):
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), 5)
                except TimeoutError:
                    break
                continue
            self.credit[stream] -= len(CHUNK)
            await self.send(Kind.DATA, stream, meta, CHUNK)
            sent += len(CHUNK)
        return sent

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def pair(deadlines: GuestDeadlines | None = None) -> AsyncIterator[tuple[GuestClient, HostileGuest]]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=host_sock)
    client = GuestClient(reader, writer, deadlines)
    g_reader, g_writer = await asyncio.open_connection(sock=guest_sock)
    guest = HostileGuest(g_reader, g_writer)
    try:
        yield client, guest
    finally:
        await client.close()
        await guest.close()


async def _peak_during(call: Awaitable[object]) -> tuple[BaseException | object, int]:
    """Run ``call``; its outcome and the traced memory peak above the start, in bytes."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        try:
            outcome: BaseException | object = await asyncio.wait_for(call, 120)
        except GuestError as exc:
            outcome = exc
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return outcome, peak


# -- a guest streaming without end -----------------------------------------------------------------


async def test_an_endless_listing_fails_with_protocol_error_and_node_memory_stays_flat() -> None:
    bound = 2 * MAX_LISTING_BYTES
    async with pair() as (client, guest):
        async def guest_side() -> int:
            frame = await guest.request("file_list")
            sent = await guest.flood(frame.stream, 4 * MAX_LISTING_BYTES)
            if frame.stream not in guest.cancelled:
                await guest.send(Kind.RESULT, frame.stream, {"count": 0})
            return sent

        flooder = asyncio.create_task(guest_side())
        outcome, peak = await _peak_during(client.list_dir("/"))
        sent = await flooder
        print(f"\nlisting flood: guest sent {sent / MIB:.1f} MiB, node peak +{peak / MIB:.1f} MiB "
              f"(cap {MAX_LISTING_BYTES / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB)")
        assert isinstance(outcome, GuestError) and outcome.code == "protocol_error", outcome
        assert peak < bound
        assert sent < MAX_LISTING_BYTES + 2 * INITIAL_WINDOW  # the client cancelled at the cap
        guest.answer_health = True
        assert (await client.health())["status"] == "ok"  # the client stays usable


async def test_endless_process_output_fails_with_protocol_error_and_node_memory_stays_flat() -> None:
    cap = 2 * PROCESS_OUTPUT_KEPT  # stdout and stderr
    async with pair() as (client, guest):
        async def guest_side() -> int:
            frame = await guest.request("proc_output")
            return await guest.flood(frame.stream, 64 * MIB, {"ch": "stdout"})

        flooder = asyncio.create_task(guest_side())
        outcome, peak = await _peak_during(client.process_output(7))
        sent = await flooder
        print(f"\nproc_output flood: guest sent {sent / MIB:.1f} MiB, node peak +{peak / MIB:.2f} MiB "
              f"(cap {cap / MIB:.0f} MiB, bound {2 * cap / MIB:.0f} MiB)")
        assert isinstance(outcome, GuestError) and outcome.code == "protocol_error", outcome
        assert peak < 2 * cap
        assert client.protocol_errors == 1


async def test_exec_output_beyond_max_output_fails_with_protocol_error() -> None:
    max_output = 4 * MIB
    async with pair() as (client, guest):
        async def guest_side() -> int:
            frame = await guest.request("exec")
            assert frame.meta["max_output"] == max_output  # the guest was told the cap
            sent = await guest.flood(frame.stream, 16 * max_output, {"ch": "stderr"})
            if frame.stream not in guest.cancelled:
                await guest.send(Kind.RESULT, frame.stream, {"exit_code": 0})
            return sent

        flooder = asyncio.create_task(guest_side())
        seen = 0

        def count(chunk: bytes) -> None:
            nonlocal seen
            seen += len(chunk)

        outcome, peak = await _peak_during(client.exec("yes", max_output=max_output, on_stderr=count))
        sent = await flooder
        print(f"\nexec flood: guest sent {sent / MIB:.1f} MiB, node peak +{peak / MIB:.1f} MiB")
        assert isinstance(outcome, GuestError) and outcome.code == "protocol_error", outcome
        assert seen <= max_output
        assert peak < 2 * 2 * max_output
        assert sent < max_output + 2 * INITIAL_WINDOW


async def test_a_file_larger_than_read_file_asked_for_fails_with_protocol_error() -> None:
    async with pair() as (client, guest):
        async def guest_side() -> None:
            frame = await guest.request("file_read")
            assert frame.meta["length"] == MIB + 1  # asked for no more than it keeps
            await guest.flood(frame.stream, 64 * MIB)

        flooder = asyncio.create_task(guest_side())
        outcome, peak = await _peak_during(client.read_file("/x", max_bytes=MIB))
        await flooder
        assert isinstance(outcome, GuestError)
        # An honest guest stops at length (then the file is too_large); this one went on.
        assert outcome.code in ("too_large", "protocol_error"), outcome
        assert peak < 4 * MIB


async def test_data_or_events_on_a_one_frame_answer_fail_the_call_and_the_client_stays_usable() -> None:
    async with pair() as (client, guest):
        call = asyncio.create_task(client.stat("/etc"))
        frame = await guest.request("file_stat")
        await guest.send(Kind.DATA, frame.stream, None, b"y" * 1000)
        with pytest.raises(GuestError) as e:
            await asyncio.wait_for(call, 10)
        assert e.value.code == "protocol_error"
        for _ in range(100):
            if frame.stream in guest.cancelled:
                break
            await asyncio.sleep(0.01)
        assert frame.stream in guest.cancelled  # the guest was told to stop

        listing = asyncio.create_task(client.list_processes())
        frame = await guest.request("proc_list")
        for _ in range(MAX_EVENTS_PER_CALL + 1):
            await guest.send(Kind.EVENT, frame.stream, {"pad": "e" * 60000})
        with pytest.raises(GuestError) as e:
            await asyncio.wait_for(listing, 10)
        assert e.value.code == "protocol_error"

        run = asyncio.create_task(client.exec("true"))
        frame = await guest.request("exec")
        await guest.send(Kind.DATA, frame.stream, {"ch": "elsewhere"}, b"z")
        with pytest.raises(GuestError) as e:
            await asyncio.wait_for(run, 10)
        assert e.value.code == "protocol_error"

        call = asyncio.create_task(client.stat("/etc"))
        frame = await guest.request("file_stat")
        await guest.send(Kind.RESULT, frame.stream, {"path": "/etc", "name": "etc", "type": "dir", "size": 0,
                                                     "mode": 0o755, "mtime": 0.0})
        assert (await asyncio.wait_for(call, 10)).type == "dir"


# -- an honest guest stays within the caps ---------------------------------------------------------


class _Recorder:
    """Stands in for the guest's channel stream: records what an operation sends."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.meta: dict[str, Any] | None = None

    def send_data(self, data: bytes, meta: dict[str, Any] | None = None) -> None:
        self.data += data

    def result(self, meta: dict[str, Any] | None = None, data: bytes = b"") -> None:
        self.meta = meta


def test_the_guest_refuses_a_listing_larger_than_the_client_accepts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_files, "MAX_LISTING_BYTES", 4096)
    for i in range(10):
        (tmp_path / f"{i:02d}").touch()
    small = _Recorder()
    guest_files.op_list(cast(Stream, small), {"path": str(tmp_path)}, b"")
    assert small.meta == {"count": 10} and 0 < len(small.data) <= 4096
    for i in range(100):
        (tmp_path / f"{i:03d}-{'n' * 40}").touch()
    big = _Recorder()
    with pytest.raises(OpError) as e:
        guest_files.op_list(cast(Stream, big), {"path": str(tmp_path)}, b"")
    assert e.value.code == "too_large" and not big.data and big.meta is None
    assert status_of(GuestError("too_large", "m")) == 413


def test_the_guest_keeps_no_more_process_output_than_the_client_accepts() -> None:
    ring = RingBuffer()
    ring.append(b"o" * (3 * PROCESS_OUTPUT_KEPT))
    data, start, end = ring.read(0)
    assert len(data) == PROCESS_OUTPUT_KEPT and end - start == PROCESS_OUTPUT_KEPT


# -- a silent guest ----------------------------------------------------------------------------------


Call = Callable[[GuestClient], Awaitable[object]]
ONE_FRAME_CALLS: dict[str, Call] = {
    "stat": lambda c: c.stat("/"),
    "list_dir": lambda c: c.list_dir("/"),
    "mkdir": lambda c: c.mkdir("/d"),
    "remove": lambda c: c.remove("/d", recursive=True),
    "rename": lambda c: c.rename("/a", "/b"),
    "proc_list": lambda c: c.list_processes(),
    "proc_start": lambda c: c.start_process("sleep 1"),
    "proc_kill": lambda c: c.kill_process(7),
    "proc_output": lambda c: c.process_output(7),
    "exec": lambda c: c.exec("true", timeout=0.1),
    "read_file": lambda c: c.read_file("/x"),
    "write_file": lambda c: c.write_file("/x", b"data"),
    "tar_import": lambda c: c.tar_import("/x", b"data"),
    "pty_open": lambda c: c.pty_open("sh"),
    "proc_stdin": lambda c: c.send_stdin(7, b"data"),
    "proc_close_stdin": lambda c: c.close_stdin(7),
    "proc_stream": lambda c: c.stream_process(7),
    "file_watch": lambda c: c.watch_dir("/"),
    "set_clock": lambda c: c.set_clock(),
    "reseed": lambda c: c.reseed(),
}


@pytest.mark.parametrize("name", sorted(ONE_FRAME_CALLS))
async def test_every_call_to_a_silent_guest_fails_at_its_deadline(name: str) -> None:
    async with pair(SHORT) as (client, _guest):
        started = time.monotonic()
        with pytest.raises(GuestTimeout) as e:
            await asyncio.wait_for(ONE_FRAME_CALLS[name](client), 20)  # the guard only catches a hang
        took = time.monotonic() - started
        assert e.value.code == "guest_timeout" and status_of(e.value) == 504
        assert took < 5, took


async def test_streams_from_a_guest_that_stops_mid_way_fail_at_the_idle_deadline() -> None:
    async with pair(SHORT) as (client, guest):
        async def consume() -> int:
            got = 0
            async for chunk in client.iter_file("/big"):
                got += len(chunk)
            return got

        reading = asyncio.create_task(consume())
        frame = await guest.request("file_read")
        await guest.send(Kind.DATA, frame.stream, None, CHUNK)  # then nothing
        with pytest.raises(GuestTimeout):
            await asyncio.wait_for(reading, 20)

        export = asyncio.create_task(client.tar_export("/").__anext__())
        await guest.request("tar_export")
        with pytest.raises(GuestTimeout):
            await asyncio.wait_for(export, 20)


async def test_an_upload_to_a_guest_that_grants_no_credit_fails_at_the_idle_deadline() -> None:
    async with pair(SHORT) as (client, guest):
        write = asyncio.create_task(client.write_file("/x", b"w" * (4 * INITIAL_WINDOW)))
        await guest.request("file_write")
        with pytest.raises(GuestTimeout) as e:
            await asyncio.wait_for(write, 20)
        assert "took no more" in e.value.message


async def test_an_untimed_exec_fails_once_the_guest_stops_answering_health() -> None:
    async with pair(SHORT) as (client, guest):
        started = time.monotonic()
        with pytest.raises(GuestTimeout) as e:
            await asyncio.wait_for(client.exec("sleep infinity"), 20)
        assert "stopped answering" in e.value.message
        assert time.monotonic() - started < 5
        assert (await guest.request("exec")).meta.get("timeout") is None


async def test_an_untimed_exec_on_a_live_guest_waits_as_long_as_the_command_runs() -> None:
    async with pair(SHORT) as (client, guest):
        guest.answer_health = True  # alive: the command is just long
        run = asyncio.create_task(client.exec("sleep 2"))
        frame = await guest.request("exec")
        await asyncio.sleep(5 * SHORT.probe_interval)
        assert not run.done()
        await guest.send(Kind.DATA, frame.stream, {"ch": "stdout"}, b"done\n")
        await guest.send(Kind.RESULT, frame.stream, {"exit_code": 0})
        result = await asyncio.wait_for(run, 10)
        assert result.ok and result.stdout == b"done\n"

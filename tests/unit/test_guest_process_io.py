"""Background processes' stdin, streamed output with reattach, and directory watches, through the real
guest daemon (a host process on a Unix socket)."""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from capsa.guest.results import WatchEvent
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.handles.output import OutputChunk, StreamEnd
from capsa.node.statuses import status_of
from tests.support.guest_waits import wait_exit
from tests.support.local_guest import LocalGuest, guest_client, local_guest

__all__ = ["guest_client", "local_guest"]

READ_LINES = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\nprint('eof')"


async def test_stdin_two_writes_then_close(guest_client: GuestClient) -> None:
    p = await guest_client.start_process(["python3", "-c", READ_LINES], stdin=True)
    assert p.stdin_open
    await guest_client.send_stdin(p.pid, b"one\n")
    await guest_client.send_stdin(p.pid, b"two\n")
    closed = await guest_client.close_stdin(p.pid)
    assert not closed.stdin_open
    await guest_client.close_stdin(p.pid)  # twice is fine
    info = await wait_exit(guest_client, p.pid, timeout=30)
    assert info.exit_code == 0
    out = await guest_client.process_output(p.pid)
    assert out.stdout == b"got one\ngot two\neof\n"
    with pytest.raises(GuestError) as e:
        await guest_client.send_stdin(p.pid, b"late\n")
    assert e.value.code == "process_exited" and status_of(e.value) == 409


async def test_stdin_refused_without_pipe_or_process(guest_client: GuestClient) -> None:
    p = await guest_client.start_process("sleep 30")
    assert not p.stdin_open
    with pytest.raises(GuestError) as e:
        await guest_client.send_stdin(p.pid, b"x")
    assert e.value.code == "stdin_closed"
    with pytest.raises(GuestError) as e:
        await guest_client.close_stdin(p.pid)
    assert e.value.code == "stdin_closed"
    await guest_client.kill_process(p.pid, 9)
    with pytest.raises(GuestError) as e:
        await guest_client.send_stdin(999999999, b"x")
    assert e.value.code == "no_such_process" and status_of(e.value) == 404


async def test_stdin_larger_than_a_frame_reaches_the_process(guest_client: GuestClient) -> None:
    p = await guest_client.start_process("wc -c", stdin=True)
    await guest_client.send_stdin(p.pid, b"x" * (3 * 1024 * 1024 + 5))
    await guest_client.close_stdin(p.pid)
    await wait_exit(guest_client, p.pid, timeout=30)
    assert (await guest_client.process_output(p.pid)).stdout.strip() == str(3 * 1024 * 1024 + 5).encode()


async def _collect(guest_client: GuestClient, pid: int, stdout_from: int = 0, stderr_from: int = 0,
                   stop_after: int | None = None) -> tuple[list[OutputChunk], StreamEnd | None]:
    stream = await guest_client.stream_process(pid, stdout_from=stdout_from, stderr_from=stderr_from)
    chunks: list[OutputChunk] = []
    async for item in stream.chunks():
        if isinstance(item, StreamEnd):
            return chunks, item
        chunks.append(item)
        if stop_after is not None and len(chunks) >= stop_after:
            await stream.close()
            return chunks, None
    return chunks, None


async def test_stream_follows_output_and_reattaches_without_loss_or_repeat(guest_client: GuestClient) -> None:
    script = "for i in $(seq 1 12); do echo line$i; echo err$i >&2; sleep 0.1; done; exit 4"
    p = await guest_client.start_process(script)
    first, end = await _collect(guest_client, p.pid, stop_after=3)
    assert end is None and first
    offsets = {"stdout": 0, "stderr": 0}
    seen = {"stdout": b"", "stderr": b""}
    for chunk in first:
        assert chunk.offset == offsets[chunk.ch]  # contiguous, from the asked offset
        seen[chunk.ch] += chunk.data
        offsets[chunk.ch] = chunk.offset + len(chunk.data)
    await asyncio.sleep(0.3)  # output goes on while nobody listens
    rest, end = await _collect(guest_client, p.pid, offsets["stdout"], offsets["stderr"])
    assert end is not None
    for chunk in rest:
        assert chunk.offset == offsets[chunk.ch] and chunk.lost == 0
        seen[chunk.ch] += chunk.data
        offsets[chunk.ch] = chunk.offset + len(chunk.data)
    assert seen["stdout"] == b"".join(b"line%d\n" % i for i in range(1, 13))
    assert seen["stderr"] == b"".join(b"err%d\n" % i for i in range(1, 13))
    assert (end.stdout_end, end.stderr_end) == (offsets["stdout"], offsets["stderr"])
    assert end.info.exit_code == 4 and not end.info.running
    # Reattaching after the end gives nothing more, only the end.
    again, end2 = await _collect(guest_client, p.pid, offsets["stdout"], offsets["stderr"])
    assert again == [] and end2 is not None and end2.info.exit_code == 4


async def test_stream_reports_bytes_the_ring_buffer_dropped(guest_client: GuestClient) -> None:
    p = await guest_client.start_process("head -c 1200000 /dev/zero")  # more than the 1 MiB kept
    await wait_exit(guest_client, p.pid, timeout=30)
    chunks, end = await _collect(guest_client, p.pid)
    assert end is not None and chunks[0].lost == 1200000 - 1024 * 1024
    assert sum(len(c.data) for c in chunks) == 1024 * 1024 and end.stdout_end == 1200000


async def test_stream_of_unknown_process_fails_before_streaming(guest_client: GuestClient) -> None:
    with pytest.raises(GuestError) as e:
        await guest_client.stream_process(999999999)
    assert e.value.code == "no_such_process"


async def _next_events(events: object, n: int) -> list[WatchEvent]:
    got: list[WatchEvent] = []
    iterator = events.__aiter__()  # type: ignore[attr-defined]
    async with asyncio.timeout(20):
        while len(got) < n:
            got.append(await anext(iterator))
    return got


async def test_watch_reports_created_modified_removed_in_order(guest_client: GuestClient,
                                                               tmp_path: pathlib.Path) -> None:
    watch = await guest_client.watch_dir(str(tmp_path))
    events = watch.events()
    target = tmp_path / "a.txt"
    target.write_bytes(b"")  # created
    await asyncio.sleep(0.3)
    await guest_client.exec(f"echo more >> {target}")  # modified
    await asyncio.sleep(0.3)
    target.unlink()  # removed
    got = await _next_events(events, 3)
    assert [(e.type, e.path) for e in got] == [("created", str(target)), ("modified", str(target)),
                                              ("removed", str(target))]
    await events.aclose()
    assert watch.closed


async def test_watch_recursive_follows_new_directories(guest_client: GuestClient,
                                                       tmp_path: pathlib.Path) -> None:
    (tmp_path / "old").mkdir()
    watch = await guest_client.watch_dir(str(tmp_path), recursive=True)
    events = watch.events()
    (tmp_path / "old" / "x").write_bytes(b"")
    got = await _next_events(events, 1)
    assert (got[0].type, got[0].path) == ("created", str(tmp_path / "old" / "x"))
    (tmp_path / "new").mkdir()
    got = await _next_events(events, 1)
    assert (got[0].type, got[0].path, got[0].is_dir) == ("created", str(tmp_path / "new"), True)
    await asyncio.sleep(0.3)  # the watch on the new directory is in place
    (tmp_path / "new" / "y").write_bytes(b"")
    got = await _next_events(events, 1)
    assert (got[0].type, got[0].path) == ("created", str(tmp_path / "new" / "y"))
    await watch.close()


async def test_watch_errors_and_end_when_directory_goes(guest_client: GuestClient,
                                                        tmp_path: pathlib.Path) -> None:
    with pytest.raises(GuestError) as e:
        await guest_client.watch_dir(str(tmp_path / "missing"))
    assert e.value.code == "not_found"
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(GuestError) as e:
        await guest_client.watch_dir(str(tmp_path / "f"))
    assert e.value.code == "not_a_directory"
    sub = tmp_path / "sub"
    sub.mkdir()
    watch = await guest_client.watch_dir(str(sub))
    os.rmdir(sub)
    async with asyncio.timeout(20):
        left = [e async for e in watch.events()]
    assert left == [] and watch.closed


async def test_closed_watch_leaves_no_thread(guest_client: GuestClient, local_guest: LocalGuest,
                                             tmp_path: pathlib.Path) -> None:
    # Requests run on reused worker threads (capsa.guest.channel.Workers): a watch whose thread were
    # still busy after close would make the next round of watches start new threads.
    assert local_guest.pid is not None

    def threads() -> int:
        return len(os.listdir(f"/proc/{local_guest.pid}/task"))

    async def open_and_close() -> int:
        watches = [await guest_client.watch_dir(str(tmp_path)) for _ in range(5)]
        busy = threads()
        for w in watches:
            await w.close()
        return busy

    await guest_client.health()
    first = await open_and_close()
    assert first >= 5
    # A closed watch's worker notices within its 0.2 s poll and goes back to the idle pool.
    rounds = []
    for _ in range(20):
        await asyncio.sleep(0.5)
        rounds.append(await open_and_close())
        if rounds[-1] <= first:
            break
    assert rounds[-1] <= first, f"closed watches kept their threads: {first} then {rounds}"


async def test_terminal_default_is_the_users_login_shell(guest_client: GuestClient) -> None:
    import pwd

    shell = pwd.getpwuid(os.geteuid()).pw_shell  # the local daemon runs as this user
    pty = await guest_client.pty_open(None)
    reader = pty.read()
    await pty.write(b"echo \"shell=$0\"; tr '\\0' ' ' < /proc/$$/cmdline; echo; exit 0\n")
    out = b""
    async with asyncio.timeout(20):
        async for chunk in reader:
            out += chunk
    text = out.decode(errors="replace")
    assert f"shell={shell}" in text and f"{shell} -l" in text, text
    assert pty.exit_code == 0

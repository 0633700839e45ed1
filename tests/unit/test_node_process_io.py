"""Terminals, stdin, streamed process output and directory watches through the node API, driven by the
control plane's NodeClient against the node app served by uvicorn on a Unix socket (fake runtime: real
guest daemons as host processes)."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from capsa.common.ids import new_id
from capsa.common.node_api import ExecRequest, ProcessStart
from capsa.common.terminal_wire import TerminalClient, TerminalOptions
from capsa.common.wire.streams import FileEvent, OutputChunk, OutputEnd, StreamError
from capsa.control.nodes.client import NodeClient, NodeError

pytestmark = pytest.mark.timeout(60)

TOKEN = "node-token-0123456789"
READ_LINES = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)"


async def _sandbox(node_url: str) -> tuple[NodeClient, str]:
    client = NodeClient(node_url, TOKEN)
    sid = new_id("sbx")
    await client.create_sandbox(sid, "base", 256, 1, {"SBX": "sandbox-env"})
    return client, sid


async def _until(term: TerminalClient, needle: bytes, seen: bytearray) -> None:
    async with asyncio.timeout(20):
        while needle not in seen:
            chunk = await term.recv()
            assert chunk is not None, f"terminal ended before {needle!r}: {bytes(seen)!r}"
            seen += chunk


async def test_terminal_size_resize_env_and_exit_status(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    try:
        term = await client.open_terminal(sid, TerminalOptions(cols=100, rows=30, cmd="/bin/sh",
                                                               env={"PS1": "$ "}))
        assert term.pid > 0
        seen = bytearray()
        await term.send(b"tty; stty size; echo $SBX\n")
        await _until(term, b"30 100", seen)
        await _until(term, b"sandbox-env", seen)
        assert b"/dev/pts/" in seen
        await term.resize(120, 40)
        await term.send(b"stty size; exit 3\n")
        async with asyncio.timeout(20):
            while (chunk := await term.recv()) is not None:
                seen += chunk
        assert b"40 120" in seen
        assert term.exit is not None and term.exit.exit_code == 3
        await term.close()
    finally:
        await client.aclose()


async def test_terminal_refusals(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    wrong = NodeClient(node_url, "wrong-token-0123456789")
    try:
        with pytest.raises(NodeError) as e:
            await wrong.open_terminal(sid, TerminalOptions())
        assert (e.value.status, e.value.code) == (401, "unauthorized")
        with pytest.raises(NodeError) as e:
            await client.open_terminal(new_id("sbx"), TerminalOptions())
        assert e.value.code == "sandbox_not_found" and e.value.status == 404
        with pytest.raises(NodeError) as e:
            await client.open_terminal(sid, TerminalOptions(cwd="/no/such/dir"))
        assert e.value.code == "not_found"
    finally:
        await wrong.aclose()
        await client.aclose()


async def test_terminal_kill_hangs_up(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    try:
        term = await client.open_terminal(sid, TerminalOptions(cmd="sleep 300"))
        await term.kill()
        async with asyncio.timeout(20):
            while await term.recv() is not None:
                pass
        assert term.exit is not None and term.exit.signal == 9
    finally:
        await client.aclose()


async def test_stdin_through_the_node(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    try:
        p = await client.start_process(sid, ProcessStart(cmd=["python3", "-c", READ_LINES], open_stdin=True))
        assert p.stdin_open
        await client.send_stdin(sid, p.pid, b"one\n")
        await client.send_stdin(sid, p.pid, b"two\n")
        assert not (await client.close_stdin(sid, p.pid)).stdin_open
        async with client.stream_process(sid, p.pid) as events:
            got = [e async for e in events]
        assert isinstance(got[-1], OutputEnd) and got[-1].exit_code == 0
        assert "".join(e.data for e in got if isinstance(e, OutputChunk)) == "got one\ngot two\n"
        with pytest.raises(NodeError) as e:
            await client.send_stdin(sid, p.pid, b"late")
        assert (e.value.status, e.value.code) == (409, "process_exited")
        with pytest.raises(NodeError) as e:
            await client.close_stdin(sid, 999999999)
        assert (e.value.status, e.value.code) == (404, "no_such_process")
    finally:
        await client.aclose()


async def test_stream_reattach_keeps_utf8_whole_and_offsets_exact(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    try:
        # Multi-byte characters written one byte at a time: no line may cut one.
        script = ("import sys, time\nfor i in range(6):\n    for b in ('é%d\\n' % i).encode():\n"
                  "        sys.stdout.buffer.write(bytes([b])); sys.stdout.flush(); time.sleep(0.02)\n")
        p = await client.start_process(sid, ProcessStart(cmd=["python3", "-c", script]))
        text, offset = "", 0
        async with client.stream_process(sid, p.pid) as events:
            async for event in events:
                assert isinstance(event, OutputChunk)
                text += event.data
                offset = event.offset
                if "é2" in text:
                    break
        assert offset == len(text.encode())
        async with client.stream_process(sid, p.pid, stdout_from=offset) as events:
            rest = [e async for e in events]
        assert isinstance(rest[-1], OutputEnd) and rest[-1].stdout_end == len("".join(
            f"é{i}\n" for i in range(6)).encode())
        text += "".join(e.data for e in rest if isinstance(e, OutputChunk))
        assert text == "".join(f"é{i}\n" for i in range(6))
        with pytest.raises(NodeError) as e:
            async with client.stream_process(sid, 999999999):
                pass
        assert e.value.code == "no_such_process"
    finally:
        await client.aclose()


async def test_watch_through_the_node(node_url: str) -> None:
    client, sid = await _sandbox(node_url)
    try:
        made = await client.exec(sid, _exec("mktemp -d"))
        folder = pathlib.Path(made.stdout.strip())
        f = folder / "f.txt"
        got: list[FileEvent | StreamError] = []
        async with client.watch_dir(sid, str(folder)) as events:
            await client.exec(sid, _exec(f"touch {f}; sleep 0.3; echo b >> {f}; sleep 0.3; rm {f}"))
            async with asyncio.timeout(20):
                async for event in events:
                    got.append(event)
                    if len(got) == 3:
                        break
        assert [(e.type, getattr(e, "path", "")) for e in got] == [
            ("created", str(f)), ("modified", str(f)), ("removed", str(f))]
        with pytest.raises(NodeError) as e:
            async with client.watch_dir(sid, str(folder / "missing")):
                pass
        assert e.value.code == "not_found"
    finally:
        await client.aclose()


def _exec(cmd: str) -> ExecRequest:
    return ExecRequest(cmd=cmd, timeout=30)

"""Terminals, stdin, streamed output and watches in a real microVM through a real ``capsa serve``.

The must-show: ``capsa shell`` driven through a pseudo-terminal runs ``tty`` (a /dev/pts device inside the
VM), sees the new size after the outer terminal is resized (TIOCSWINSZ + SIGWINCH) and exits with the
shell's status. Then a background process's stdin, a reattached output stream and a directory watch in
the same VM, and a session closed under an open terminal and streams leaves no VM behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx
import pytest

from capsa.sdk import AsyncClient, AsyncSession, FileEvent, OutputChunk
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.pty_driver import PtyDriver
from tests.support.served import CAPSA, Served

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def _tenant(served: Served, admin: str, tenant: str) -> str:
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {admin}"}, timeout=600) as a:
        made = a.post("/v1/keys", json={"tenant": tenant})
        assert made.status_code == 201, made.text
        return str(made.json()["key"])


def test_capsa_shell_in_a_vm_tty_resize_and_exit_status(server: tuple[Served, str]) -> None:
    served, admin = server
    key = _tenant(served, admin, "acme-shell")
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as c:
        created = c.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
                   "TERM": "xterm", "CAPSA_API_URL": served.url, "CAPSA_API_KEY": key}
            status = asyncio.run(_drive_shell(sid, env))
            assert status == 3
        finally:
            c.post(f"/v1/sessions/{sid}/close")


async def _drive_shell(sid: str, env: dict[str, str]) -> int:
    async with PtyDriver.spawn([*CAPSA, "shell", sid], env=env, cols=80, rows=24) as term:
        started = time.monotonic()
        term.send(b"tty; stty size; echo ready-$((40+2))\r")
        end = await term.expect(b"ready-42", timeout=300)
        out = term.output.decode(errors="replace")
        assert "/dev/pts/" in out, out
        assert "24 80" in out, out
        print(f"shell up and answering after {time.monotonic() - started:.2f} s")
        term.set_size(132, 43)  # TIOCSWINSZ on the outer pty + SIGWINCH to capsa shell
        await asyncio.sleep(0.5)
        term.send(b"stty size\r")
        await term.expect(b"43 132", after=end, timeout=120)
        term.send(b"exit 3\r")
        return await term.wait(timeout=120)


def test_stdin_stream_reattach_and_watch_in_a_vm(server: tuple[Served, str]) -> None:
    served, admin = server
    key = _tenant(served, admin, "acme-io")
    asyncio.run(_process_io(served.url, key))


async def _process_io(url: str, key: str) -> None:
    async with AsyncClient(url, key, timeout=600) as client, \
            await AsyncSession.create(client=client) as s:
        reader = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)"
        proc = await s.commands.run(["python3", "-c", reader], background=True, open_stdin=True)
        await proc.send_stdin("first\n")
        await proc.send_stdin("second\n")
        await proc.close_stdin()
        got: list[str] = []
        done = await proc.wait(timeout=120, on_stdout=got.append)
        assert "".join(got) == "got first\ngot second\n" and done.exit_code == 0

        ticker = await s.commands.run("for i in $(seq 1 20); do echo n$i; sleep 0.1; done", background=True)
        seen = ""
        async for event in ticker.stream():
            assert isinstance(event, OutputChunk)
            seen += event.data
            if "n5" in seen:
                break
        again = await s.commands.connect(ticker.pid, stdout_from=ticker.stdout_offset)
        rest: list[str] = []
        await again.wait(timeout=120, on_stdout=rest.append)
        assert seen + "".join(rest) == "".join(f"n{i}\n" for i in range(1, 21))

        await s.commands.run("mkdir -p /tmp/watched")
        events: list[FileEvent] = []
        async with await s.files.watch("/tmp/watched") as watch:
            await s.commands.run("touch /tmp/watched/f; sleep 0.3; echo x >> /tmp/watched/f; sleep 0.3; "
                                 "rm /tmp/watched/f")
            async with asyncio.timeout(60):
                async for event in watch:
                    events.append(event)
                    if len(events) == 3:
                        break
        assert [(e.type, e.path) for e in events] == [
            ("created", "/tmp/watched/f"), ("modified", "/tmp/watched/f"), ("removed", "/tmp/watched/f")]


def test_closing_under_an_open_terminal_and_streams_leaves_no_vm(server: tuple[Served, str]) -> None:
    served, admin = server
    key = _tenant(served, admin, "acme-close")
    asyncio.run(_close_under_streams(served.url, key))
    assert wait_no_vm_leftovers(served.state_dir) == []


async def _close_under_streams(url: str, key: str) -> None:
    async with AsyncClient(url, key, timeout=600) as client:
        s = await AsyncSession.create(client=client)
        term = await s.pty.create(cmd="sleep 600")
        proc = await s.commands.run("sleep 600", background=True)
        watch = await s.files.watch("/tmp")

        async def follow() -> None:
            with contextlib.suppress(Exception):
                async for _ in proc.stream():
                    pass

        streaming = asyncio.create_task(follow())
        await asyncio.sleep(1)
        await s.close()
        async with asyncio.timeout(120):
            with contextlib.suppress(Exception):
                await term.wait()
            await streaming
            with contextlib.suppress(Exception):
                async for _ in watch:
                    pass
        await watch.aclose()
        await term.close()

"""``capsa shell SESSION``: an interactive terminal in a session's sandbox, in the user's own terminal.

The local terminal is put in raw mode (every key goes to the sandbox: Ctrl-C interrupts the remote
command, not this one) and restored on the way out, whatever happens; its size is sent at start and again
on every SIGWINCH. The exit status is the remote shell's (``exit 3`` -> 3; killed by signal N -> 128 + N).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator

import click

from capsa.cli.output import ApiOptions, api_options, fail, reports_errors
from capsa.sdk import AsyncSession, AsyncTerminal

__all__ = ["shell"]

READ_SIZE = 64 * 1024


@click.command("shell")
@api_options
@click.option("--cmd", "command", default=None, help="Run this command line instead of the login shell.")
@click.option("--cwd", default=None, help="Working directory inside the sandbox.")
@click.option("--user", default=None, help="User to run as inside the sandbox.")
@click.argument("session_id")
def shell(api: ApiOptions, command: str | None, cwd: str | None, user: str | None, session_id: str) -> None:
    """Open an interactive terminal in SESSION_ID's sandbox (the login shell, or --cmd). Exits with the
    remote command's status."""
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    if fd < 0 or not os.isatty(fd):
        fail("capsa shell needs a terminal on stdin (use `capsa exec` for commands without one)", 2)
    with reports_errors():
        status = asyncio.run(_shell(api, session_id, command, cwd, user, fd))
    sys.exit(status)


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return max(1, size.columns), max(1, size.lines)


async def _shell(api: ApiOptions, session_id: str, command: str | None, cwd: str | None, user: str | None,
                 fd: int) -> int:
    session = await AsyncSession.connect(session_id, api_url=api.api_url, api_key=api.api_key)
    try:
        cols, rows = _size(fd)
        term = await session.pty.create(cols, rows, command, cwd=cwd, user=user,
                                        env={"TERM": os.environ.get("TERM", "xterm-256color")})
        try:
            with _raw(fd):
                await _attach(term, fd, sys.stdout.fileno())
        finally:
            await term.close()
        if term.exit_code is not None:
            return term.exit_code
        if term.signal is not None:
            return 128 + term.signal
        return 1
    finally:
        await session.disconnect()


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _attach(term: AsyncTerminal, in_fd: int, out_fd: int) -> None:
    """Keys -> the terminal, its output -> our stdout, SIGWINCH -> resize, until the remote side ends."""
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[bytes | tuple[int, int]] = asyncio.Queue()  # key bytes, or a new size
    size = [_size(in_fd)]

    def resized() -> None:
        now = _size(in_fd)
        if now != size[0]:
            size[0] = now
            keys.put_nowait(now)

    def readable() -> None:
        # Keys typed after a resize must reach a terminal of the new size, even when the loop sees the
        # keys before the SIGWINCH: check the size first.
        resized()
        try:
            data = os.read(in_fd, READ_SIZE)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(in_fd)  # our stdin closed: nothing more to send, output goes on
        keys.put_nowait(data)

    def winch() -> None:
        resized()

    async def send() -> None:
        while item := await keys.get():
            if isinstance(item, tuple):
                await term.resize(*item)
            else:
                await term.send(item)

    loop.add_reader(in_fd, readable)
    loop.add_signal_handler(signal.SIGWINCH, winch)
    sender = asyncio.create_task(send())
    try:
        while (chunk := await term.recv()) is not None:
            view = memoryview(chunk)
            while view:
                view = view[os.write(out_fd, view):]
    finally:
        loop.remove_reader(in_fd)
        loop.remove_signal_handler(signal.SIGWINCH)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender

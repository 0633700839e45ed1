"""Drive an interactive program through a pseudo-terminal (stdlib ``pty.fork``), from asyncio tests.

    async with PtyDriver.spawn([capsa, "shell", sid], env=env, cols=80, rows=24) as term:
        await term.expect(b"$ ")
        term.send(b"tty\\r")
        term.set_size(120, 40)           # TIOCSWINSZ on our side of the pty; the kernel sends SIGWINCH
        status = await term.wait()       # the exit status (128 + N for a signal)

Reads never block the event loop (the server under test may run on the same loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import signal
import struct
import termios
import time
from collections.abc import Mapping, Sequence

__all__ = ["PtyDriver"]


class PtyDriver:
    def __init__(self, pid: int, master: int) -> None:
        self.pid = pid
        self.master = master
        self.output = bytearray()
        """Everything the program wrote to its terminal so far."""
        self.status: int | None = None
        self._eof = False

    @classmethod
    def spawn(cls, argv: Sequence[str], *, env: Mapping[str, str], cols: int = 80,
              rows: int = 24) -> PtyDriver:
        pid, master = pty.fork()
        if pid == 0:  # the child: its stdin/stdout/stderr are the pty's slave, its controlling terminal
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                os.execve(argv[0], list(argv), dict(env))
            finally:
                os._exit(127)
        os.set_blocking(master, False)
        return cls(pid, master)

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.master, view):]

    def set_size(self, cols: int, rows: int) -> None:
        """Resize the terminal as a terminal emulator does: TIOCSWINSZ, then SIGWINCH to the program."""
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGWINCH)

    async def _read(self) -> bool:
        """Wait for output and append it; False at EOF."""
        if self._eof:
            return False
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self.master, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(self.master)
        try:
            chunk = os.read(self.master, 65536)
        except BlockingIOError:
            return True
        except OSError:  # EIO: the program closed its side
            chunk = b""
        if not chunk:
            self._eof = True
            return False
        self.output += chunk
        return True

    async def expect(self, needle: bytes, *, after: int = 0, timeout: float = 60) -> int:  # noqa: ASYNC109
        """Wait until ``needle`` appears in the output after offset ``after``; its end offset."""
        async with asyncio.timeout(timeout):
            while (at := self.output.find(needle, after)) < 0:
                if not await self._read():
                    raise AssertionError(f"the program ended before writing {needle!r}: "
                                         f"{bytes(self.output)!r}")
        return at + len(needle)

    async def wait(self, timeout: float = 60) -> int:  # noqa: ASYNC109
        """Read until EOF and reap the program; its exit status (128 + N when signal N killed it)."""
        async with asyncio.timeout(timeout):
            while await self._read():
                pass
            deadline = time.monotonic() + timeout
            while True:
                pid, status = os.waitpid(self.pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG does not block
                if pid:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the program did not exit")
                await asyncio.sleep(0.05)
        self.status = os.waitstatus_to_exitcode(status)
        if self.status < 0:
            self.status = 128 - self.status
        return self.status

    def close(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.master)

    async def __aenter__(self) -> PtyDriver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

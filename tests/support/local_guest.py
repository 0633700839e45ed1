"""Run the real capsa guest daemon as a host process on a Unix socket (fast tests, no VM).

The daemon is started the way the guest image runs it: the ``capsa/guest`` package is copied into
a private directory next to an empty ``capsa/__init__.py`` and run with Debian's ``/usr/bin/python3``
(the same interpreter version as in the guest) with nothing else on ``PYTHONPATH``, so a test run
also proves the daemon needs only the standard library.

    async with LocalGuest() as guest:
        client = await guest.client()
        result = await client.exec("echo hi")

``set_clock`` and ``set_hostname`` are refused (``--no-clock``): they would change the host.
``stop()`` sends SIGTERM, on which the daemon kills every command it started. A daemon killed with
SIGKILL cannot do that: its commands run in their own sessions and outlive it. To be safe against
that too, launch it inside a PID namespace (``python=`` a wrapper; see tests/support/fake_runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest_asyncio

from capsa.node.guestlink.client import GuestClient

__all__ = ["GUEST_PACKAGE", "LocalGuest", "guest_client", "local_guest", "local_guest_client"]

GUEST_PACKAGE = Path(__file__).resolve().parents[2] / "src" / "capsa" / "guest"


def _default_python() -> str:
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


class LocalGuest:
    """One guest daemon process with its own working directory; ``stop()`` leaves nothing behind."""

    def __init__(self, workdir: Path | None = None, *, python: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="capsa-local-guest-")) if workdir is None else workdir
        self.socket_path = self.workdir / "agent.sock"
        self.python = python or _default_python()
        self.extra_args = list(extra_args)
        self.process: asyncio.subprocess.Process | None = None
        self._clients: list[GuestClient] = []

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    async def start(self, timeout: float = 15) -> None:  # noqa: ASYNC109
        lib = self.workdir / "lib"
        pkg = lib / "capsa"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        shutil.copytree(GUEST_PACKAGE, pkg / "guest", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        read_fd, write_fd = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib),
               "PYTHONDONTWRITEBYTECODE": "1", "HOME": os.environ.get("HOME", "/root")}
        try:
            self.process = await asyncio.create_subprocess_exec(
                self.python, "-m", "capsa.guest", "--listen-unix", str(self.socket_path),
                "--ready-fd", str(write_fd), "--no-clock", *self.extra_args,
                pass_fds=(write_fd,), env=env, start_new_session=True, cwd=str(self.workdir),
            )
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            await self.stop()
            raise
        os.close(write_fd)
        try:
            loop = asyncio.get_running_loop()
            line = await asyncio.wait_for(loop.run_in_executor(None, os.read, read_fd, 64), timeout)
            if not line.startswith(b"ready"):
                raise RuntimeError(f"guest daemon exited before listening (code {self.process.returncode})")
        except BaseException:
            await self.stop()
            raise
        finally:
            os.close(read_fd)

    async def client(self) -> GuestClient:
        """A new connection to the daemon; closed by ``stop()``."""
        client = await GuestClient.connect_unix(self.socket_path)
        self._clients.append(client)
        return client

    async def stop(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
        proc = self.process
        if proc is not None and proc.returncode is None:
            # SIGTERM lets the daemon kill every process it started before it exits.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def __aenter__(self) -> LocalGuest:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def local_guest_client(**kwargs: object) -> AsyncIterator[tuple[LocalGuest, GuestClient]]:
    """A started daemon and one connected client, both torn down afterwards."""
    guest = LocalGuest(**kwargs)  # type: ignore[arg-type]
    await guest.start()
    try:
        yield guest, await guest.client()
    finally:
        await guest.stop()


@pytest_asyncio.fixture
async def local_guest() -> AsyncIterator[LocalGuest]:
    """pytest fixture: a running local guest daemon (import it into a test module to use it)."""
    guest = LocalGuest()
    await guest.start()
    try:
        yield guest
    finally:
        await guest.stop()


@pytest_asyncio.fixture
async def guest_client(local_guest: LocalGuest) -> AsyncIterator[GuestClient]:
    """pytest fixture: a GuestClient connected to ``local_guest``."""
    yield await local_guest.client()

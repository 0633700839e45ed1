"""What the node API calls on one sandbox's guest: :class:`SandboxGuest`, handed out by the agent.

Each operation runs with the sandbox's env under the command's own, and fails with a stable code:
``sandbox_failed`` when the VM died, ``guest_unavailable`` when the guest channel broke, else the guest's
own code (:class:`~capsa.node.guestlink.errors.GuestRefused`; capsa.node.api.errors maps codes to HTTP
statuses).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Iterator, Mapping, Sequence
from typing import Literal, TypeVar

from capsa.common.errors import CapsaError
from capsa.guest.limits import DEFAULT_MAX_OUTPUT
from capsa.guest.results import FileInfo, ProcessInfo
from capsa.node.guestlink.client import ExecResult, GuestClient, ProcessOutput
from capsa.node.guestlink.errors import GuestRefused
from capsa.node.guestlink.handles.output import OutputStream
from capsa.node.guestlink.handles.pty import PtyHandle
from capsa.node.guestlink.handles.tunnel import TcpTunnel
from capsa.node.guestlink.handles.watch import DirWatch
from capsa.node.runtime.base import Sandbox, SandboxState

__all__ = ["ExecChunk", "SandboxGuest"]

T = TypeVar("T")

ExecChunk = tuple[Literal["stdout", "stderr"], bytes]
"""A piece of a running command's output (:meth:`SandboxGuest.exec_stream`)."""
# Guest failures that mean the channel, not the request, failed.
_GUEST_GONE = frozenset({"channel_closed", "internal_error", "guest_unavailable"})


class SandboxGuest:
    """The guest of sandbox ``sandbox_id``; ``env`` is the sandbox's env (commands' own env goes over it)."""

    def __init__(self, sandbox_id: str, sandbox: Sandbox, env: Mapping[str, str]) -> None:
        self.sandbox_id = sandbox_id
        self._sandbox = sandbox
        self._guest: GuestClient = sandbox.guest
        self._env = env

    def _with_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**self._env, **(env or {})}

    async def _run(self, call: Awaitable[T]) -> T:
        with self._call():
            return await call

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        try:
            yield
        except (CapsaError, OSError, EOFError, asyncio.IncompleteReadError) as exc:
            failure = self._failure(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _failure(self, exc: BaseException) -> BaseException:
        if self._sandbox.state == SandboxState.FAILED:
            return CapsaError(f"sandbox {self.sandbox_id} failed: {self._sandbox.failure or 'VM died'}",
                              code="sandbox_failed", status=409)
        if isinstance(exc, CapsaError) and exc.code == "sandbox_failed":
            return exc
        if isinstance(exc, CapsaError) and exc.code not in _GUEST_GONE:
            return GuestRefused(exc.code, exc.message)
        return CapsaError(f"guest channel failed: {getattr(exc, 'message', None) or type(exc).__name__}",
                          code="guest_unavailable", status=503)

    # -- commands and processes --------------------------------------------------------------------------
    async def exec(self, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None,  # noqa: ASYNC109 - the guest enforces it
                   max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        """Run a command to its end and return its output."""
        return await self._run(self._guest.exec(cmd, env=self._with_env(env), cwd=cwd, user=user, stdin=stdin,
                                                timeout=timeout, max_output=max_output))

    def exec_stream(self, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                    timeout: float | None = None,
                    max_output: int = DEFAULT_MAX_OUTPUT) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        """Run a command, yielding its output as it comes and then its :class:`ExecResult`.

        A failure is raised by the iterator. Closing the iterator early kills the command in the guest."""
        return self._exec_events(cmd, env=self._with_env(env), cwd=cwd, user=user, stdin=stdin,
                                 timeout=timeout, max_output=max_output)

    async def _exec_events(self, cmd: str | Sequence[str], *, env: dict[str, str], cwd: str | None,
                           user: str | None, stdin: bytes | None,
                           timeout: float | None,  # noqa: ASYNC109
                           max_output: int) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        # Bounded: a caller that reads slowly holds up the guest (through the channel's credit window).
        queue: asyncio.Queue[ExecChunk] = asyncio.Queue(maxsize=64)
        run = asyncio.create_task(self._guest.exec(
            cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout, max_output=max_output,
            on_stdout=lambda b: queue.put(("stdout", b)), on_stderr=lambda b: queue.put(("stderr", b))))
        getter: asyncio.Future[ExecChunk] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait((getter, run), return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                with self._call():
                    result = run.result()
                yield result
                return
        finally:
            if getter is not None:
                getter.cancel()
            if not run.done():
                run.cancel()  # the caller went away: cancelling kills the guest process
            with contextlib.suppress(asyncio.CancelledError, CapsaError, OSError, EOFError):
                await run

    async def start_process(self, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                            cwd: str | None = None, user: str | None = None,
                            stdin: bool = False) -> ProcessInfo:
        return await self._run(self._guest.start_process(cmd, env=self._with_env(env), cwd=cwd, user=user,
                                                         stdin=stdin))

    async def send_stdin(self, pid: int, data: bytes) -> ProcessInfo:
        return await self._run(self._guest.send_stdin(pid, data))

    async def close_stdin(self, pid: int) -> ProcessInfo:
        return await self._run(self._guest.close_stdin(pid))

    async def stream_process(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> OutputStream:
        """The process's output from the given offsets until it exits (``no_such_process`` raises here)."""
        return await self._run(self._guest.stream_process(pid, stdout_from=stdout_from,
                                                          stderr_from=stderr_from))

    async def list_processes(self) -> list[ProcessInfo]:
        return await self._run(self._guest.list_processes())

    async def get_process(self, pid: int) -> ProcessInfo:
        for info in await self.list_processes():
            if info.pid == pid:
                return info
        raise CapsaError(f"no process {pid}", code="not_found", status=404)

    async def kill_process(self, pid: int, signal: int) -> ProcessInfo:
        return await self._run(self._guest.kill_process(pid, signal))

    async def process_output(self, pid: int) -> ProcessOutput:
        return await self._run(self._guest.process_output(pid))

    async def open_terminal(self, *, cols: int, rows: int, cmd: str | None = None,
                            env: Mapping[str, str] | None = None, cwd: str | None = None,
                            user: str | None = None) -> PtyHandle:
        """A command (default: the login shell) on a pseudo-terminal in the sandbox."""
        return await self._run(self._guest.pty_open(cmd, cols=cols, rows=rows, env=self._with_env(env),
                                                    cwd=cwd, user=user))

    async def open_port(self, port: int) -> TcpTunnel:
        """A TCP connection to ``127.0.0.1:port`` inside the sandbox, over the guest channel
        (``port_unreachable`` when nothing listens there)."""
        return await self._run(self._guest.tcp_open(port))

    # -- files --------------------------------------------------------------------------------------------
    async def watch_dir(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Changes under a directory of the sandbox until closed (a bad path raises here)."""
        return await self._run(self._guest.watch_dir(path, recursive=recursive))

    async def read_file(self, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes; the first chunk is read before this returns, so a missing file raises here."""
        return await self._first_then_rest(self._guest.iter_file(path))

    async def write_file(self, path: str, data: AsyncIterable[bytes], mode: int | None = None) -> FileInfo:
        return await self._run(self._guest.write_file(path, data, mode=mode))

    async def list_dir(self, path: str) -> list[FileInfo]:
        return await self._run(self._guest.list_dir(path))

    async def stat(self, path: str) -> FileInfo:
        return await self._run(self._guest.stat(path))

    async def mkdir(self, path: str, *, parents: bool = True) -> FileInfo:
        return await self._run(self._guest.mkdir(path, parents=parents))

    async def rename(self, src: str, dst: str) -> FileInfo:
        with self._call():
            await self._guest.rename(src, dst)
            return await self._guest.stat(dst)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._run(self._guest.remove(path, recursive=recursive))

    async def export_archive(self, path: str) -> AsyncGenerator[bytes, None]:
        """A tar stream of ``path``; like :meth:`read_file`, a failure to start raises here."""
        return await self._first_then_rest(self._guest.tar_export(path))

    async def import_archive(self, path: str, data: AsyncIterable[bytes]) -> None:
        await self._run(self._guest.tar_import(path, data))

    async def _first_then_rest(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        with self._call():
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""

        async def rest() -> AsyncGenerator[bytes, None]:
            try:
                if first:
                    yield first
                with self._call():
                    async for chunk in chunks:
                        yield chunk
            finally:
                await chunks.aclose()

        return rest()

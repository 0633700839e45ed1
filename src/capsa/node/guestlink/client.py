"""The operations of the guest daemon, as the node calls them (the plumbing is :mod:`.connection`).

What each call collects is capped by the operation's own limit: exec output ``max_output`` per stream,
``proc_output`` :data:`~capsa.guest.protocol.PROCESS_OUTPUT_KEPT` per stream (what the guest keeps),
``file_list`` :data:`~capsa.guest.protocol.MAX_LISTING_BYTES`, ``read_file`` its ``max_bytes`` (the guest
is asked for no more). The long-lived calls hand back a handle (:mod:`.handles`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from capsa.guest.limits import DEFAULT_MAX_OUTPUT
from capsa.guest.protocol import CHUNK_SIZE, MAX_LISTING_BYTES, PROCESS_OUTPUT_KEPT, Frame, Kind
from capsa.guest.results import FileInfo, ProcessInfo, opt_int
from capsa.node.guestlink.connection import GuestConnection
from capsa.node.guestlink.errors import ChannelClosed, GuestError, GuestTimeout
from capsa.node.guestlink.handles.output import OutputStream
from capsa.node.guestlink.handles.pty import PtyHandle
from capsa.node.guestlink.handles.tunnel import TcpTunnel
from capsa.node.guestlink.handles.watch import DirWatch
from capsa.node.guestlink.streams import CallStream, loop_time

__all__ = [
    "DEFAULT_MAX_READ",
    "ExecResult",
    "GuestClient",
    "OutputCallback",
    "ProcessOutput",
]

DEFAULT_MAX_READ = 64 * 1024 * 1024
"""What :meth:`GuestClient.read_file` collects at most (larger files: ``iter_file``)."""
STDIN_PIECE = 512 * 1024
"""Bytes per ``proc_stdin`` request (the body rides inline in the request frame, at most 1 MiB)."""

OutputCallback = Callable[[bytes], Awaitable[None] | None]
H = TypeVar("H")


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration: float
    pid: int | None = None
    oom_killed: bool = False
    """An OOM killer (the guest kernel's, or a memory cgroup's) killed a process of this command, as
    counted by the command's own cgroup (memory.events ``oom_kill``)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class ProcessOutput:
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    running: bool
    exit_code: int | None
    signal: int | None
    stdout_end: int = 0
    """Absolute offset after the last stdout byte: pass it back as ``stdout_from`` to get only new output."""
    stderr_end: int = 0



class GuestClient(GuestConnection):
    """The guest daemon's operations over one connection. Use from a single event loop."""

    async def wait_ready(self, timeout: float = 30,  # noqa: ASYNC109
                         interval: float = 0.5) -> dict[str, object]:
        """Retry health until the daemon answers (a port's early bytes can be lost while the guest boots)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return await self.health(timeout=max(0.05, min(interval, remaining)))
            except GuestError as exc:
                if isinstance(exc, ChannelClosed) or time.monotonic() >= deadline:
                    raise
                if exc.code not in ("guest_timeout", "protocol_error", "malformed_frame"):
                    raise

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the guest enforces it
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run a command to completion. A string runs under ``/bin/sh -c``; a sequence is an argv.

        Output beyond ``max_output`` bytes per stream is dropped (the guest still drains the pipe)
        and flagged as truncated; a guest that sends more fails the call with ``protocol_error``.
        Callbacks see every byte that was kept, as it arrives. A guest that overruns ``timeout`` +
        ``exec_grace`` fails the call with ``guest_timeout``; without a ``timeout``, so does one that stops
        answering (no frame for ``probe_interval``, then no health). A command with a timeout is never
        probed: a guest under memory or fork pressure may be too slow to answer health for a while, and the
        deadline already bounds the wait.
        """
        args: dict[str, Any] = {
            "cmd": cmd if isinstance(cmd, str) else list(cmd), "env": env, "cwd": cwd, "user": user,
            "timeout": timeout, "max_output": max_output, "stdin": stdin is not None,
        }
        started = time.monotonic()
        # The guest enforces ``timeout``; this deadline only catches a guest that stopped answering.
        deadline = self.deadline_in(None if timeout is None else timeout + self.deadlines.exec_grace)
        stream = await self.request("exec", args, limits={"stdout": max_output, "stderr": max_output},
                                    deadline=self.deadline_in(self.deadlines.call))
        buffers = {"stdout": bytearray(), "stderr": bytearray()}
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        uploader: asyncio.Task[None] | None = None
        try:
            if stdin is not None:
                uploader = asyncio.get_running_loop().create_task(stream.upload(stdin))
            while True:
                try:
                    frame = await self.next_frame(stream, deadline, probe=deadline is None)
                except GuestTimeout as exc:
                    if deadline is None or loop_time() < deadline:
                        raise
                    message = (f"the guest did not finish the command within its timeout "
                               f"({timeout} s) + {self.deadlines.exec_grace} s")
                    raise GuestTimeout(message) from exc
                if frame.kind == Kind.DATA:
                    ch = frame.meta.get("ch")
                    if ch not in buffers:
                        continue
                    buf = buffers[ch]
                    keep = frame.data[: max(0, max_output - len(buf))]
                    buf += keep
                    callback = callbacks[ch]
                    if callback is not None and keep:
                        maybe = callback(keep)
                        if inspect.isawaitable(maybe):
                            await maybe
                elif frame.kind == Kind.RESULT:
                    meta = frame.meta
                    return ExecResult(
                        exit_code=opt_int(meta.get("exit_code")), signal=opt_int(meta.get("signal")),
                        stdout=bytes(buffers["stdout"]), stderr=bytes(buffers["stderr"]),
                        stdout_truncated=bool(meta.get("stdout_truncated")),
                        stderr_truncated=bool(meta.get("stderr_truncated")),
                        timed_out=bool(meta.get("timed_out")),
                        duration=time.monotonic() - started, pid=opt_int(meta.get("pid")),
                        oom_killed=meta.get("oom_killed") is True,
                    )
        finally:
            if uploader is not None:
                if not uploader.done():
                    uploader.cancel()
                with contextlib.suppress(asyncio.CancelledError, GuestError):
                    await uploader  # its failure (the guest took no stdin) is the command's to report
            await self.abandon(stream)

    async def start_process(self, cmd: str | Sequence[str], *, env: dict[str, str] | None = None,
                            cwd: str | None = None, user: str | int | None = None,
                            stdin: bool = False) -> ProcessInfo:
        """Start a background process; with ``stdin`` it keeps a pipe for :meth:`send_stdin`."""
        args = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "env": env, "cwd": cwd, "user": user,
                "stdin": stdin or None}
        return ProcessInfo.from_meta((await self.call("proc_start", args)).meta)

    async def send_stdin(self, pid: int, data: bytes) -> ProcessInfo:
        """Write to the process's stdin (``stdin_closed``/``process_exited`` 409 when it cannot take it).
        Waits while the pipe is full; the call's long deadline bounds a process that never reads."""
        info: ProcessInfo | None = None
        for i in range(0, max(1, len(data)), STDIN_PIECE):
            frame = await self.call("proc_stdin", {"pid": pid}, data[i: i + STDIN_PIECE],
                                    timeout=self.deadlines.long_call)
            info = ProcessInfo.from_meta(frame.meta)
        assert info is not None
        return info

    async def close_stdin(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_meta((await self.call("proc_close_stdin", {"pid": pid})).meta)

    async def stream_process(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> OutputStream:
        """Open the process's output stream (raises ``no_such_process`` before anything streams)."""
        return await self._open_handle("proc_stream", {"pid": pid, "stdout_from": stdout_from,
                                                       "stderr_from": stderr_from},
                                       started="streaming", seconds=self.deadlines.call,
                                       make=lambda stream, _: OutputStream(self, stream, pid))

    async def watch_dir(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch a directory (raises ``not_found``/``not_a_directory`` before anything streams)."""
        return await self._open_handle("file_watch", {"path": path, "recursive": recursive},
                                       started="watching", seconds=self.deadlines.long_call,
                                       make=lambda stream, _: DirWatch(self, stream, path))

    async def list_processes(self) -> list[ProcessInfo]:
        meta = (await self.call("proc_list")).meta
        return [ProcessInfo.from_meta(p) for p in meta.get("processes", [])]

    async def kill_process(self, pid: int, signal: int = 15) -> ProcessInfo:
        return ProcessInfo.from_meta((await self.call("proc_kill", {"pid": pid, "signal": signal})).meta)

    async def process_output(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> ProcessOutput:
        """What the guest kept of the process's output (at most PROCESS_OUTPUT_KEPT bytes per stream)."""
        deadline = loop_time() + self.deadlines.call
        stream = await self.request("proc_output", {"pid": pid, "stdout_from": stdout_from,
                                    "stderr_from": stderr_from},
                                    limits={"stdout": PROCESS_OUTPUT_KEPT, "stderr": PROCESS_OUTPUT_KEPT},
                                    deadline=deadline)
        out = {"stdout": bytearray(), "stderr": bytearray()}
        try:
            while True:
                frame = await self.next_frame(stream, deadline)
                if frame.kind == Kind.DATA and frame.meta.get("ch") in out:
                    out[frame.meta["ch"]] += frame.data
                elif frame.kind == Kind.RESULT:
                    m = frame.meta
                    return ProcessOutput(
                        stdout=bytes(out["stdout"]), stderr=bytes(out["stderr"]),
                        stdout_truncated=bool(m.get("stdout_truncated")),
                        stderr_truncated=bool(m.get("stderr_truncated")),
                        running=bool(m.get("running")), exit_code=opt_int(m.get("exit_code")),
                        signal=opt_int(m.get("signal")), stdout_end=int(m.get("stdout_end", 0)),
                        stderr_end=int(m.get("stderr_end", 0)),
                    )
        finally:
            await self.abandon(stream)

    async def pty_open(self, cmd: str | Sequence[str] | None = None, cols: int = 80, rows: int = 24,
                       env: dict[str, str] | None = None, *, cwd: str | None = None,
                       user: str | int | None = None) -> PtyHandle:
        args = {"cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd), "cols": cols, "rows": rows,
                "env": env, "cwd": cwd, "user": user}
        return await self._open_handle(
            "pty_open", args, started="started", seconds=self.deadlines.idle,
            make=lambda stream, frame: PtyHandle(self, stream, int(frame.meta["pid"])))

    async def tcp_open(self, port: int, *, connect_timeout: float = 10.0) -> TcpTunnel:
        """Connect to ``127.0.0.1:port`` inside the guest (``port_unreachable`` if nothing listens there)."""
        return await self._open_handle(
            "tcp_open", {"port": port, "connect_timeout": connect_timeout}, started="connected",
            seconds=connect_timeout + self.deadlines.call,
            make=lambda stream, _: TcpTunnel(self, stream, port),
            ended=lambda: GuestError("port_unreachable", f"port {port} closed the connection at once"))

    async def _open_handle(self, op: str, args: dict[str, Any], *, started: str, seconds: float,
                           make: Callable[[CallStream, Frame], H],
                           ended: Callable[[], GuestError] | None = None) -> H:
        """Open a streamed call and wait, ``seconds`` at most, for the guest's EVENT ``started``; then
        ``make`` the handle. With ``ended``, a RESULT before that event fails the call with its error."""
        deadline = loop_time() + seconds
        stream = await self.request(op, args, limits=None, deadline=deadline)
        try:
            while True:
                frame = await self.next_frame(stream, deadline)
                if frame.kind == Kind.EVENT and frame.meta.get(started):
                    return make(stream, frame)
                if frame.kind == Kind.RESULT and ended is not None:
                    raise ended()
        except BaseException:
            await self.abandon(stream)
            raise

    async def read_file(self, path: str, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file, if it holds at most ``max_bytes`` (else ``too_large``; stream it with iter_file).
        The guest is asked for ``max_bytes + 1`` bytes; one that sends more fails with ``protocol_error``."""
        stream = await self.request("file_read", {"path": path, "length": max_bytes + 1},
                                    limits={None: max_bytes + 1},
                                    deadline=self.deadline_in(self.deadlines.idle))
        out = bytearray()
        try:
            while True:
                frame = await self.next_frame(stream, self.deadline_in(self.deadlines.idle))
                if frame.kind == Kind.DATA:
                    out += frame.data
                    if len(out) > max_bytes:
                        raise GuestError("too_large", f"{path} is larger than the {max_bytes} bytes "
                                                      "read_file collects")
                elif frame.kind == Kind.RESULT:
                    return bytes(out)
        finally:
            await self.abandon(stream)

    async def iter_file(self, path: str, chunk: int = CHUNK_SIZE) -> AsyncGenerator[bytes, None]:
        """The file's bytes as they arrive (guest chunks are at most 64 KiB; ``chunk`` caps them lower).
        Not capped: the caller consumes the stream, within the credit window."""
        idle = self.deadlines.idle
        stream = await self.request("file_read", {"path": path}, limits=None, deadline=self.deadline_in(idle))
        try:
            while True:
                frame = await self.next_frame(stream, self.deadline_in(idle))
                if frame.kind == Kind.DATA:
                    data = frame.data
                    for i in range(0, len(data), max(1, chunk)):
                        yield data[i: i + chunk]
                elif frame.kind == Kind.RESULT:
                    return
        finally:
            await self.abandon(stream)

    async def write_file(self, path: str, data: bytes | AsyncIterable[bytes],
                         mode: int | None = None) -> FileInfo:
        """Write atomically (temporary file + rename); missing parent directories are created."""
        stream = await self.request("file_write", {"path": path, "mode": mode}, limits={},
                                    deadline=self.deadline_in(self.deadlines.idle))
        try:
            await stream.upload(data)
            return FileInfo.from_meta((await self.result_frame(stream, self.deadlines.long_call)).meta)
        finally:
            await self.abandon(stream)

    async def list_dir(self, path: str) -> list[FileInfo]:
        """The directory's entries (the guest refuses a listing over MAX_LISTING_BYTES with too_large)."""
        deadline = loop_time() + self.deadlines.call
        stream = await self.request("file_list", {"path": path}, limits={None: MAX_LISTING_BYTES},
                                    deadline=deadline)
        raw = bytearray()
        try:
            while True:
                frame = await self.next_frame(stream, deadline)
                if frame.kind == Kind.DATA:
                    raw += frame.data
                elif frame.kind == Kind.RESULT:
                    break
        finally:
            await self.abandon(stream)
        try:
            entries = json.loads(raw) if raw else []
            return [FileInfo.from_meta(e) for e in entries]
        except (ValueError, KeyError, TypeError) as exc:
            raise GuestError("protocol_error", f"guest sent a bad directory listing: {exc}") from None

    async def stat(self, path: str) -> FileInfo:
        return FileInfo.from_meta((await self.call("file_stat", {"path": path})).meta)

    async def mkdir(self, path: str, parents: bool = True, mode: int | None = None) -> FileInfo:
        return FileInfo.from_meta((await self.call("file_mkdir", {"path": path, "parents": parents,
                                                   "mode": mode})).meta)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self.call("file_remove", {"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str) -> None:
        await self.call("file_rename", {"src": src, "dst": dst})

    async def tar_export(self, path: str) -> AsyncGenerator[bytes, None]:
        """A tar stream (PAX format, uncompressed) of the directory's contents, or of one file."""
        idle = self.deadlines.idle
        stream = await self.request("tar_export", {"path": path}, limits=None,
                                    deadline=self.deadline_in(idle))
        try:
            while True:
                frame = await self.next_frame(stream, self.deadline_in(idle))
                if frame.kind == Kind.DATA:
                    yield frame.data
                elif frame.kind == Kind.RESULT:
                    return
        finally:
            await self.abandon(stream)

    async def tar_import(self, path: str, data: bytes | AsyncIterable[bytes]) -> None:
        """Extract a tar stream (optionally gzip/bzip2/xz compressed) into the directory ``path``."""
        stream = await self.request("tar_import", {"path": path}, limits={},
                                    deadline=self.deadline_in(self.deadlines.idle))
        try:
            await stream.upload(data)
            await self.result_frame(stream, self.deadlines.long_call)
        finally:
            await self.abandon(stream)

    async def set_clock(self, unix_ns: int | None = None) -> None:
        await self.call("set_clock", {"unix_ns": time.time_ns() if unix_ns is None else unix_ns})

    async def reseed(self, entropy: bytes | None = None) -> None:
        await self.call("reseed", data=os.urandom(64) if entropy is None else entropy)

    async def set_hostname(self, name: str) -> None:
        """Name the guest (identity is injected when a pooled sandbox is bound to a session)."""
        await self.call("set_hostname", {"name": name})

    async def set_aslr(self, enabled: bool) -> None:
        """Whether commands the guest spawns from now on get a randomized address-space layout."""
        await self.call("set_aslr", {"enabled": enabled})

    async def poweroff(self) -> None:
        """Ask the guest init to sync and power the VM off (only under the capsa init)."""
        await self.call("poweroff")

"""Host side of the guest channel: an asyncio client for the capsa guest daemon.

One reader task decodes frames and routes them to per-request streams. Inbound data per stream is
bounded by the credit window (the guest may not send more than we have acknowledged, and we only
acknowledge what the caller has consumed), so a slow consumer costs at most one window of memory.
A lost connection fails every pending call at once with :class:`ChannelClosed`.

A guest daemon that dies (a user command ran ``kill -9 -1``) does not close the connection: QEMU's
host side of a virtio-serial port does not see the guest closing it. The guest's PID 1 restarts the
daemon, and the new instance announces itself with a hello naming a fresh instance id (see
:mod:`capsa.guest.protocol`); the client then fails every call in flight at once with
:class:`GuestUnavailable` (``guest_unavailable``) and addresses later requests to the new instance.
Requests that were still on their way to the dead one are refused unrun by its successor, with the
same error.

A hostile guest (its root is the tenant's) is bounded two more ways:

* **Bytes per call.** Every result the client collects has a cap taken from the operation's own limit:
  exec output ``max_output`` per stream, ``proc_output`` :data:`PROCESS_OUTPUT_KEPT` per stream (what
  the guest keeps), ``file_list`` :data:`MAX_LISTING_BYTES`, ``read_file`` its ``max_bytes`` (the
  guest is asked for no more), and no DATA at all for the one-frame answers (stat, proc_list, ...).
  At most :data:`MAX_EVENTS_PER_CALL` EVENT frames per call. Streamed results (``iter_file``,
  ``tar_export``, a terminal) go to the caller as they arrive, within the credit window, and are not
  capped. A guest past a cap fails that call with ``protocol_error`` at the frame that crosses it
  (nothing more is buffered); the client sends CANCEL, drops the stream's later frames and stays
  usable for other calls. The sandbox is not failed: a guest can only break its own sandbox's calls.
* **Time per call.** Every call has a deadline (:class:`GuestDeadlines`): one-frame answers
  ``call``, slow file operations ``long_call``, streamed phases ``idle`` between frames or credit,
  exec and ``proc_wait`` their own timeout + ``exec_grace``; while an exec or a wait is silent for
  ``probe_interval`` the client asks the guest for ``health``, so a guest that stopped answering fails
  a command without a timeout too. Past a deadline the call fails with :class:`GuestTimeout`
  (``guest_timeout``, 504).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import random
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any

from capsa.common.errors import CapsaError
from capsa.guest.protocol import (
    CHUNK_SIZE,
    INITIAL_WINDOW,
    INSTANCE_KEY,
    MAX_LISTING_BYTES,
    PROCESS_OUTPUT_KEPT,
    UNAVAILABLE,
    Decoder,
    Frame,
    Kind,
    encode_frame,
    hello_instance,
)

__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "DEFAULT_MAX_READ",
    "EXEC_TIMEOUT_GRACE",
    "MAX_EVENTS_PER_CALL",
    "ChannelClosed",
    "DirWatch",
    "ExecResult",
    "FileInfo",
    "GuestClient",
    "GuestDeadlines",
    "GuestError",
    "GuestTimeout",
    "GuestUnavailable",
    "OutputCallback",
    "OutputChunk",
    "OutputStream",
    "ProcessInfo",
    "ProcessOutput",
    "PtyHandle",
    "StreamEnd",
    "TcpTunnel",
    "WatchEvent",
]

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
DEFAULT_MAX_READ = 64 * 1024 * 1024
"""What :meth:`GuestClient.read_file` collects at most (larger files: ``iter_file``)."""
READ_SIZE = 256 * 1024
# How long past its own timeout a command may take to be reported before the client gives up on the guest.
EXEC_TIMEOUT_GRACE = 60.0
# Data frames are bounded by the credit window; this bounds the small ones (events, empty data).
MAX_QUEUED_FRAMES = 4096
MAX_EVENTS_PER_CALL = 16
STDIN_PIECE = 512 * 1024
"""Bytes per ``proc_stdin`` request (the body rides inline in the request frame, at most 1 MiB)."""
"""EVENT frames a call accepts (the daemon sends one, ``started``): their meta is not flow controlled."""

OutputCallback = Callable[[bytes], Awaitable[None] | None]

_STATUS = {
    "bad_request": 400,
    "unknown_op": 400,
    "unsafe_archive": 400,
    "not_found": 404,
    "no_such_process": 404,
    "permission_denied": 403,
    "is_a_directory": 409,
    "not_a_directory": 409,
    "already_exists": 409,
    "directory_not_empty": 409,
    "no_space": 507,
    "timeout": 504,
    "guest_timeout": 504,
    "too_large": 413,
    "unsupported": 501,
    "port_unreachable": 502,
    "process_exited": 409,
    "stdin_closed": 409,
    UNAVAILABLE: 503,
}


@dataclass(frozen=True)
class GuestDeadlines:
    """How long the client waits for a guest (seconds) before failing a call with ``guest_timeout``."""

    call: float = 60.0
    """A one-frame answer (health has its own ``timeout``; stat, mkdir, proc_list, proc_output, ...)."""
    long_call: float = 600.0
    """Answers that may take long in an honest guest: recursive remove, rename across filesystems,
    the result of file_write and tar_import once their body is sent."""
    idle: float = 120.0
    """Streamed phases (file and tar reads, uploads, a terminal starting): the longest wait for the next
    frame, or for credit to send more."""
    exec_grace: float = EXEC_TIMEOUT_GRACE
    """Past a command's own timeout (exec, proc_wait), which the guest enforces."""
    probe_interval: float = 30.0
    """An exec or proc_wait silent this long makes the client check the guest with health ..."""
    probe: float = 10.0
    """... which must answer within this; also the most a CANCEL may wait to be written."""


class GuestError(CapsaError):
    """The guest answered a request with an error (``code`` is the guest's stable error code)."""

    code = "guest_error"
    status = 502

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message or code, code=code, status=_STATUS.get(code, 502))


class GuestUnavailable(GuestError):
    """The guest daemon instance serving the request died (PID 1 restarts it; the sandbox stays usable).
    The request may have run partly; later calls go to the new instance."""

    def __init__(self, message: str) -> None:
        super().__init__(UNAVAILABLE, message)


class GuestTimeout(GuestError):
    """The guest did not answer a call by its deadline (:class:`GuestDeadlines`)."""

    def __init__(self, message: str) -> None:
        super().__init__("guest_timeout", message)


class ChannelClosed(GuestError):
    """The connection to the guest is gone; every pending and future call fails with this."""

    def __init__(self, message: str = "guest channel closed") -> None:
        super().__init__("channel_closed", message)


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
class ProcessInfo:
    pid: int
    cmd: str
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: float
    finished_at: float | None = None
    stdin_open: bool = False
    """The process was started with ``stdin`` and its stdin is not closed yet."""

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ProcessInfo:
        return cls(pid=int(meta["pid"]), cmd=str(meta.get("cmd", "")), running=bool(meta.get("running")),
                   exit_code=_opt_int(meta.get("exit_code")), signal=_opt_int(meta.get("signal")),
                   started_at=float(meta.get("started_at") or 0.0),
                   finished_at=_opt_float(meta.get("finished_at")), stdin_open=meta.get("stdin_open") is True)


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a background process wrote: ``data`` starts at byte ``offset`` of its ``ch`` stream."""

    ch: str  # "stdout" | "stderr"
    offset: int
    data: bytes
    lost: int = 0
    """Bytes before ``offset`` that were asked for but had already left the guest's ring buffer."""


@dataclass(frozen=True)
class StreamEnd:
    """The process exited and every byte it wrote was streamed; the offsets after its last bytes."""

    info: ProcessInfo
    stdout_end: int
    stderr_end: int


@dataclass(frozen=True)
class WatchEvent:
    type: str  # "created" | "modified" | "removed" | "overflow"
    path: str
    is_dir: bool


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


@dataclass(frozen=True)
class FileInfo:
    path: str
    name: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int  # permission bits
    mtime: float

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> FileInfo:
        return cls(path=str(meta["path"]), name=str(meta["name"]), type=str(meta["type"]),
                   size=int(meta["size"]), mode=int(meta["mode"]), mtime=float(meta["mtime"]))


def _stream_meta(meta: dict[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    ch = meta.get("ch")
    if isinstance(ch, str) and len(ch) <= 16:
        kept["ch"] = ch
    for key in ("offset", "lost"):
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            kept[key] = value
    return kept


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


Limits = Mapping[str | None, int]
"""Bytes a call accepts per DATA channel (``meta["ch"]``, None for frames without one); a channel not
named accepts none. ``None`` instead of a mapping: the call streams to its caller and is not capped."""


class _Stream:
    """Client-side state of one request."""

    def __init__(self, client: GuestClient, stream_id: int, op: str, limits: Limits | None) -> None:
        self.client = client
        self.id = stream_id
        self.op = op
        self.limits = limits
        self.received: dict[str | None, int] = {}
        self.events = 0
        self.queue: asyncio.Queue[Frame | BaseException] = asyncio.Queue()
        self.send_credit = INITIAL_WINDOW
        self.credit_changed = asyncio.Event()
        self.recv_allowed = INITIAL_WINDOW  # bytes the guest may still send before more credit
        self.recv_unacked = 0  # consumed bytes not yet returned as credit
        self.done = False  # RESULT/ERROR arrived (or the connection died)
        self.failure: BaseException | None = None

    def _admit(self, frame: Frame) -> Frame | GuestError:
        """The frame as queued (DATA keeps only its channel), or the protocol error it amounts to."""
        if frame.kind == Kind.EVENT:
            self.events += 1
            if self.events > MAX_EVENTS_PER_CALL:
                return GuestError("protocol_error", f"guest sent more than {MAX_EVENTS_PER_CALL} events "
                                                    f"for one {self.op}")
            return frame
        if frame.kind != Kind.DATA:
            return frame
        self.recv_allowed -= len(frame.data)
        if self.recv_allowed < 0:
            return GuestError("flow_control", "guest sent more data than the window allows")
        if self.limits is None:
            # Streamed to the caller: keep only the small fields a stream uses (proc_stream's channel and
            # offsets), so queued frames cost their data, not up to 64 KiB of meta each.
            return Frame(Kind.DATA, frame.stream, _stream_meta(frame.meta), frame.data)
        ch = frame.meta.get("ch")
        key = ch if isinstance(ch, str) else None
        if key not in self.limits:
            return GuestError("protocol_error", f"guest sent data on channel {str(key)[:40]!r}, which "
                                                f"{self.op} does not have")
        total = self.received.get(key, 0) + len(frame.data)
        self.received[key] = total
        if total > self.limits[key]:
            what = f"{key} of " if key else ""
            return GuestError("protocol_error", f"guest sent more than {self.limits[key]} bytes of "
                                                f"{what}{self.op}, the most it may")
        return Frame(Kind.DATA, frame.stream, {"ch": key} if key else {}, frame.data)

    def deliver(self, item: Frame | BaseException) -> None:
        if self.failure is not None:
            return  # a failed request takes nothing more (a misbehaving guest cannot grow the queue)
        if isinstance(item, Frame) and item.kind != Kind.WINDOW and self.queue.qsize() >= MAX_QUEUED_FRAMES:
            item = GuestError("flow_control", "guest sent too many frames without them being read")
        if isinstance(item, Frame):
            if item.kind == Kind.WINDOW:
                n = item.meta.get("n")
                if isinstance(n, int) and 0 < n <= 1 << 40:
                    self.send_credit += n
                    self.credit_changed.set()
                return
            item = self._admit(item)
            if isinstance(item, Frame) and item.kind in (Kind.RESULT, Kind.ERROR):
                self.done = True
        if isinstance(item, BaseException):
            # Failures overtake queued data: the caller learns at its next read, not after a backlog.
            self.done = True
            if self.failure is None:
                self.failure = item
        self.queue.put_nowait(item)
        self.credit_changed.set()

    async def next(self, deadline: float | None = None) -> Frame:
        """Next frame for the caller; raises the guest's error or ChannelClosed, and TimeoutError when
        nothing came by ``deadline`` (loop time; nothing is lost then)."""
        if self.failure is not None:
            raise self.failure
        if deadline is None:
            item = await self.queue.get()
        else:
            async with asyncio.timeout_at(deadline):
                item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.kind == Kind.ERROR:
            raise GuestError(item.code, item.message)
        if item.kind == Kind.DATA and item.data:
            await self._ack(len(item.data))
        return item

    async def _ack(self, n: int) -> None:
        self.recv_unacked += n
        if self.recv_unacked >= INITIAL_WINDOW // 4 and not self.done:
            grant, self.recv_unacked = self.recv_unacked, 0
            self.recv_allowed += grant
            await self.client._send(Kind.WINDOW, self.id, {"n": grant})

    async def send_data(self, data: bytes) -> bool:
        """Send within credit; returns False when the guest already finished the request. Waiting longer
        than the client's idle deadline for credit fails with GuestTimeout."""
        view = memoryview(data)
        while view:
            while self.send_credit <= 0 and not self.done:
                self.credit_changed.clear()
                idle = self.client.deadlines.idle
                try:
                    await asyncio.wait_for(self.credit_changed.wait(), idle)
                except TimeoutError:
                    raise GuestTimeout(f"the guest took no more of the {self.op} body for {idle} s") from None
            if self.done:
                if self.failure is not None:
                    raise self.failure
                return False
            n = min(len(view), CHUNK_SIZE, self.send_credit)
            self.send_credit -= n
            await self.client._send(Kind.DATA, self.id, None, bytes(view[:n]))
            view = view[n:]
        return True

    async def upload(self, data: bytes | AsyncIterable[bytes]) -> None:
        """Send a whole body followed by END (stops early if the guest already answered)."""
        if isinstance(data, bytes | bytearray | memoryview):
            ok = await self.send_data(bytes(data))
        else:
            ok = True
            async for piece in data:
                if not await self.send_data(bytes(piece)):
                    ok = False
                    break
        if ok and not self.done:
            await self.client._send(Kind.END, self.id)


class PtyHandle:
    """An open terminal in the guest."""

    def __init__(self, stream: _Stream, pid: int) -> None:
        self._stream = stream
        self.pid = pid
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.closed = False

    async def write(self, data: bytes) -> None:
        if not await self._stream.send_data(data):
            raise GuestError("bad_request", "the terminal has exited")

    async def resize(self, rows: int, cols: int) -> None:
        await self._stream.client._send(Kind.EVENT, self._stream.id, {"rows": rows, "cols": cols})

    async def send_signal(self, sig: int) -> None:
        """Signal the terminal's process group; the exit comes through :meth:`read` as usual."""
        await self._stream.client._send(Kind.EVENT, self._stream.id, {"signal": sig})

    async def read(self) -> AsyncIterator[bytes]:
        """Terminal output until the command exits (then ``exit_code``/``signal`` are set)."""
        while not self.closed:
            try:
                frame = await self._stream.next()
            except GuestError as exc:
                if exc.code == "cancelled":
                    self.closed = True
                    return
                raise
            if frame.kind == Kind.DATA:
                yield frame.data
            elif frame.kind == Kind.RESULT:
                self._finish(frame.meta)
                return

    def _finish(self, meta: dict[str, Any]) -> None:
        self.exit_code = _opt_int(meta.get("exit_code"))
        self.signal = _opt_int(meta.get("signal"))
        self.closed = True
        self._stream.client._forget(self._stream)

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Hang up the terminal (SIGHUP to its processes) and wait for it to be gone."""
        if self.closed:
            return
        stream = self._stream
        with contextlib.suppress(ChannelClosed):
            await stream.client._send(Kind.CANCEL, stream.id)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    frame = await stream.next()
                    if frame.kind == Kind.RESULT:
                        self._finish(frame.meta)
                        return
        except (GuestError, TimeoutError):
            pass
        self.closed = True
        stream.client._forget(stream)


class TcpTunnel:
    """A TCP connection to a port inside the guest (``tcp_open``), carried on one channel stream.

    ``write`` waits for the guest's credit (so a fast sender is held back by a slow port), ``read`` yields
    what the port sent, within the client's credit (acknowledged as the caller consumes it), until the
    server closes its side. ``end`` half-closes (the server reads EOF); ``close`` drops the connection."""

    def __init__(self, stream: _Stream, port: int) -> None:
        self._stream = stream
        self.port = port
        self.closed = False
        self.bytes_in: int | None = None
        self.bytes_out: int | None = None
        """Byte counts the guest reported when the server closed (None until then)."""

    async def write(self, data: bytes) -> None:
        if data and not await self._stream.send_data(data):
            raise GuestError("port_unreachable", f"port {self.port} closed the connection")

    async def end(self) -> None:
        """Half-close: the server reads EOF; what it still sends keeps coming through ``read``."""
        if not self._stream.done:
            await self._stream.client._send(Kind.END, self._stream.id)

    async def read(self) -> AsyncGenerator[bytes, None]:
        """What the port sends, until it closes its side."""
        while not self.closed:
            frame = await self._stream.next()
            if frame.kind == Kind.DATA:
                if frame.data:
                    yield frame.data
            elif frame.kind == Kind.RESULT:
                self.bytes_in = _opt_int(frame.meta.get("bytes_in"))
                self.bytes_out = _opt_int(frame.meta.get("bytes_out"))
                self.closed = True
                self._stream.client._forget(self._stream)
                return

    async def close(self) -> None:
        """Drop the connection (the guest closes the socket); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        await self._stream.client._abandon(self._stream)


class OutputStream:
    """A background process's output as it is written (``proc_stream``), from given offsets to its exit.

    ``chunks()`` yields :class:`OutputChunk` and lastly one :class:`StreamEnd`; a process that stays silent
    is fine (the client checks the guest with health meanwhile). ``close()`` stops streaming; the process
    runs on."""

    def __init__(self, stream: _Stream, pid: int) -> None:
        self._stream = stream
        self.pid = pid
        self.closed = False

    async def chunks(self) -> AsyncGenerator[OutputChunk | StreamEnd, None]:
        client = self._stream.client
        try:
            while not self.closed:
                frame = await client._next(self._stream, None, probe=True)
                if frame.kind == Kind.DATA:
                    ch = frame.meta.get("ch")
                    offset = _opt_int(frame.meta.get("offset"))
                    if ch not in ("stdout", "stderr") or offset is None or offset < 0:
                        raise GuestError("protocol_error", "guest sent process output without channel/offset")
                    yield OutputChunk(str(ch), offset, frame.data, _opt_int(frame.meta.get("lost")) or 0)
                elif frame.kind == Kind.RESULT:
                    self.closed = True
                    yield StreamEnd(ProcessInfo.from_meta(frame.meta), int(frame.meta.get("stdout_end", 0)),
                                    int(frame.meta.get("stderr_end", 0)))
                    return
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
        await self._stream.client._abandon(self._stream)


class DirWatch:
    """A watched directory (``file_watch``): ``events()`` until ``close()`` or the directory is removed."""

    MAX_LINE = 64 * 1024

    def __init__(self, stream: _Stream, path: str) -> None:
        self._stream = stream
        self.path = path
        self.closed = False

    async def events(self) -> AsyncGenerator[WatchEvent, None]:
        pending = b""
        try:
            while not self.closed:
                frame = await self._stream.next()
                if frame.kind == Kind.RESULT:
                    self.closed = True
                    return
                if frame.kind != Kind.DATA:
                    continue
                pending += frame.data
                *lines, pending = pending.split(b"\n")
                if len(pending) > self.MAX_LINE:
                    raise GuestError("protocol_error", "guest sent an overlong watch event")
                for line in lines:
                    yield _watch_event(line)
        finally:
            await self.close()

    async def close(self) -> None:
        self.closed = True
        await self._stream.client._abandon(self._stream)


def _watch_event(line: bytes) -> WatchEvent:
    try:
        raw = json.loads(line)
        kind, path = raw["type"], raw["path"]
        if kind not in ("created", "modified", "removed", "overflow") or not isinstance(path, str):
            raise ValueError(kind)
        return WatchEvent(kind, path, raw.get("is_dir") is True)
    except (ValueError, KeyError, TypeError) as exc:
        raise GuestError("protocol_error", f"guest sent a bad watch event: {exc!r}"[:200]) from None


_LONG_OPS = frozenset({"file_remove", "file_rename", "poweroff"})


class GuestClient:
    """Talks to one guest daemon over an asyncio stream pair. Use from a single event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 deadlines: GuestDeadlines | None = None) -> None:
        self.deadlines = deadlines or GuestDeadlines()
        """How long calls wait for the guest; may be replaced (tests shorten them)."""
        self._reader = reader
        self._writer = writer
        self._decoder = Decoder()
        self._streams: dict[int, _Stream] = {}
        # Start somewhere random: after a reconnect, a stale frame from the previous connection's
        # request must not land on a new request that happens to get the same id.
        self._next_id = random.randrange(1, 1 << 30)
        self._closed: BaseException | None = None
        self._write_lock = asyncio.Lock()
        self.protocol_errors = 0
        self.instance: str | None = None
        """The guest daemon instance this client talks to (learnt from its hello or ``health``)."""
        self.daemon_restarts = 0
        """How many times a new daemon instance replaced the one the client knew."""
        self.last_restart: float | None = None
        """``time.monotonic()`` when the client last learnt of a new daemon instance."""
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect_unix(cls, path: str | os.PathLike[str],
                           deadlines: GuestDeadlines | None = None) -> GuestClient:
        reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=READ_SIZE)
        return cls(reader, writer, deadlines)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    # -- plumbing --------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        reason: BaseException = ChannelClosed("guest closed the channel")
        try:
            while True:
                chunk = await self._reader.read(READ_SIZE)
                if not chunk:
                    break
                for frame in self._decoder.feed(chunk):
                    self._route(frame)
        except asyncio.CancelledError:
            reason = ChannelClosed("guest client closed")
        except (OSError, EOFError) as exc:
            reason = ChannelClosed(f"guest channel failed: {exc}")
        except Exception as exc:  # never leave callers hanging on a bug here
            reason = ChannelClosed(f"guest channel reader crashed: {exc!r}")
        self._fail_all(reason)

    def _fail_all(self, reason: BaseException) -> None:
        if self._closed is None:
            self._closed = reason
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.deliver(reason)

    def _learn_instance(self, instance: str, how: str) -> None:
        """A daemon instance spoke. When it replaces the one we knew, every call in flight is lost."""
        if instance == self.instance:
            return
        previous, self.instance = self.instance, instance
        if previous is None:
            return  # first contact
        self.daemon_restarts += 1
        self.last_restart = time.monotonic()
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.deliver(GuestUnavailable(
                f"the guest daemon died and was restarted ({how}); the call in flight was lost"))

    def _route(self, frame: Frame) -> None:
        hello = hello_instance(frame)
        if hello is not None:
            self._learn_instance(hello, "a new instance announced itself")
            return
        if frame.kind == Kind.ERROR and frame.code == UNAVAILABLE and not frame.malformed:
            other = frame.meta.get(INSTANCE_KEY)
            if isinstance(other, str) and other:
                stream = self._streams.pop(frame.stream, None)
                self._learn_instance(other, "a new instance refused a request meant for the old one")
                if stream is not None:
                    stream.deliver(GuestUnavailable(frame.message or "the guest daemon restarted"))
                return
        if frame.malformed or (frame.stream == 0 and frame.kind == Kind.ERROR):
            self.protocol_errors += 1
            stream = self._streams.get(frame.stream)
            if stream is not None:
                stream.deliver(GuestError(frame.code, frame.message))
                self._streams.pop(frame.stream, None)
            elif frame.stream == 0:
                # We cannot tell which request lost bytes, so none of them can be trusted to finish.
                err = GuestError("protocol_error", f"undecodable bytes on the guest channel: {frame.message}")
                streams = list(self._streams.values())
                self._streams.clear()
                for s in streams:
                    s.deliver(err)
            return
        stream = self._streams.get(frame.stream)
        if stream is None:
            return  # late frames for requests we abandoned
        stream.deliver(frame)
        if frame.kind in (Kind.RESULT, Kind.ERROR) or stream.failure is not None:
            # Finished, or failed (past a cap, out of window): later frames for it are dropped unread.
            if stream.failure is not None:
                self.protocol_errors += 1
            self._streams.pop(frame.stream, None)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ChannelClosed(str(self._closed)) if not isinstance(self._closed, ChannelClosed) \
                else ChannelClosed(self._closed.message)

    async def _send(self, kind: Kind, stream_id: int, meta: dict[str, Any] | None = None,
                    data: bytes = b"") -> None:
        self._check_open()
        raw = encode_frame(kind, stream_id, meta, data)
        try:
            async with self._write_lock:
                self._writer.write(raw)
                await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            self._fail_all(ChannelClosed(f"guest channel write failed: {exc}"))
            self._check_open()

    def _forget(self, stream: _Stream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    async def _open(self, op: str, args: dict[str, Any] | None = None, data: bytes = b"", *,
                    limits: Limits | None, deadline: float | None) -> _Stream:
        """Start a request whose answers are capped by ``limits``; sending it must finish by ``deadline``."""
        self._check_open()
        stream_id = self._next_id
        self._next_id = self._next_id + 1 if self._next_id < 0xFFFFFFF0 else 1
        stream = _Stream(self, stream_id, op, limits)
        self._streams[stream_id] = stream
        meta: dict[str, Any] = {"op": op}
        if args:
            meta.update({k: v for k, v in args.items() if v is not None})
        if self.instance is not None:
            meta[INSTANCE_KEY] = self.instance
        try:
            async with asyncio.timeout_at(deadline):
                await self._send(Kind.REQUEST, stream_id, meta, data)
        except TimeoutError:
            self._forget(stream)
            raise GuestTimeout(f"the guest took no {op} request for {self._budget(deadline)} s") from None
        except (ValueError, TypeError) as exc:  # too large, or not JSON: the caller's input
            self._forget(stream)
            raise GuestError("bad_request", f"cannot send {op} request: {exc}") from None
        except BaseException:
            self._forget(stream)
            raise
        return stream

    async def _abandon(self, stream: _Stream) -> None:
        """The caller gave up (cancelled, timed out, broke out of a stream, past a cap): tell the guest."""
        if stream.done and stream.failure is None:
            self._forget(stream)
            return
        self._forget(stream)
        stream.done = True
        if self._closed is None:
            # Best effort: a guest that stopped reading its port must not hold the caller here either.
            with contextlib.suppress(ChannelClosed, OSError, TimeoutError):
                async with asyncio.timeout(self.deadlines.probe):
                    await asyncio.shield(self._send(Kind.CANCEL, stream.id))

    def _deadline(self, seconds: float | None) -> float | None:
        return None if seconds is None else loop_time() + seconds

    def _budget(self, deadline: float | None) -> str:
        return "?" if deadline is None else f"{max(0.0, deadline - loop_time()):.3g}"

    async def _next(self, stream: _Stream, deadline: float | None, *, probe: bool = False) -> Frame:
        """The stream's next frame by ``deadline``, else GuestTimeout. With ``probe`` (a command that may
        rightly stay silent), every ``probe_interval`` without a frame the guest must answer health."""
        while True:
            until = deadline
            if probe:
                check = loop_time() + self.deadlines.probe_interval
                until = check if deadline is None else min(deadline, check)
            try:
                return await stream.next(until)
            except TimeoutError:
                if not probe or (deadline is not None and loop_time() >= deadline):
                    raise GuestTimeout(f"the guest did not answer {stream.op} by its deadline") from None
            try:
                await self.health(timeout=self.deadlines.probe)
            except GuestTimeout:
                raise GuestTimeout(f"the guest stopped answering during {stream.op}: nothing for "
                                   f"{self.deadlines.probe_interval} s, then no health within "
                                   f"{self.deadlines.probe} s") from None

    async def _call(self, op: str, args: dict[str, Any] | None = None, data: bytes = b"",
                    timeout: float | None = None) -> Frame:  # noqa: ASYNC109
        """A request answered by one RESULT (no DATA), by ``timeout`` (default: the op's deadline)."""
        if timeout is None:
            timeout = self.deadlines.long_call if op in _LONG_OPS else self.deadlines.call
        deadline = loop_time() + timeout
        stream = await self._open(op, args, data, limits={}, deadline=deadline)
        try:
            while True:
                try:
                    frame = await self._next(stream, deadline)
                except GuestTimeout:
                    raise GuestTimeout(f"guest did not answer {op} within {timeout:g} s") from None
                if frame.kind == Kind.RESULT:
                    return frame
        finally:
            await self._abandon(stream)

    async def _result(self, stream: _Stream, seconds: float) -> Frame:
        """Skip to the stream's RESULT, within ``seconds``."""
        deadline = loop_time() + seconds
        while True:
            frame = await self._next(stream, deadline)
            if frame.kind == Kind.RESULT:
                return frame

    # -- operations ------------------------------------------------------------------------------

    async def health(self, timeout: float = 5) -> dict[str, object]:  # noqa: ASYNC109
        meta = dict((await self._call("health", timeout=timeout)).meta)
        instance = meta.get(INSTANCE_KEY)
        if isinstance(instance, str) and instance:
            self._learn_instance(instance, "health named a new instance")
        return meta

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
        deadline = self._deadline(None if timeout is None else timeout + self.deadlines.exec_grace)
        stream = await self._open("exec", args, limits={"stdout": max_output, "stderr": max_output},
                                  deadline=self._deadline(self.deadlines.call))
        buffers = {"stdout": bytearray(), "stderr": bytearray()}
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        uploader: asyncio.Task[None] | None = None
        try:
            if stdin is not None:
                uploader = asyncio.get_running_loop().create_task(stream.upload(stdin))
            while True:
                try:
                    frame = await self._next(stream, deadline, probe=deadline is None)
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
                        exit_code=_opt_int(meta.get("exit_code")), signal=_opt_int(meta.get("signal")),
                        stdout=bytes(buffers["stdout"]), stderr=bytes(buffers["stderr"]),
                        stdout_truncated=bool(meta.get("stdout_truncated")),
                        stderr_truncated=bool(meta.get("stderr_truncated")),
                        timed_out=bool(meta.get("timed_out")),
                        duration=time.monotonic() - started, pid=_opt_int(meta.get("pid")),
                        oom_killed=meta.get("oom_killed") is True,
                    )
        finally:
            if uploader is not None:
                if not uploader.done():
                    uploader.cancel()
                with contextlib.suppress(asyncio.CancelledError, GuestError):
                    await uploader  # its failure (the guest took no stdin) is the command's to report
            await self._abandon(stream)

    async def start_process(self, cmd: str | Sequence[str], *, env: dict[str, str] | None = None,
                            cwd: str | None = None, user: str | int | None = None,
                            stdin: bool = False) -> ProcessInfo:
        """Start a background process; with ``stdin`` it keeps a pipe for :meth:`send_stdin`."""
        args = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "env": env, "cwd": cwd, "user": user,
                "stdin": stdin or None}
        return ProcessInfo.from_meta((await self._call("proc_start", args)).meta)

    async def send_stdin(self, pid: int, data: bytes) -> ProcessInfo:
        """Write to the process's stdin (``stdin_closed``/``process_exited`` 409 when it cannot take it).
        Waits while the pipe is full; the call's long deadline bounds a process that never reads."""
        info: ProcessInfo | None = None
        for i in range(0, max(1, len(data)), STDIN_PIECE):
            frame = await self._call("proc_stdin", {"pid": pid}, data[i: i + STDIN_PIECE],
                                     timeout=self.deadlines.long_call)
            info = ProcessInfo.from_meta(frame.meta)
        assert info is not None
        return info

    async def close_stdin(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_meta((await self._call("proc_close_stdin", {"pid": pid})).meta)

    async def stream_process(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> OutputStream:
        """Open the process's output stream (raises ``no_such_process`` before anything streams)."""
        deadline = loop_time() + self.deadlines.call
        stream = await self._open("proc_stream", {"pid": pid, "stdout_from": stdout_from,
                                                   "stderr_from": stderr_from},
                                  limits=None, deadline=deadline)
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.EVENT and frame.meta.get("streaming"):
                    return OutputStream(stream, pid)
        except BaseException:
            await self._abandon(stream)
            raise

    async def watch_dir(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch a directory (raises ``not_found``/``not_a_directory`` before anything streams)."""
        deadline = loop_time() + self.deadlines.long_call
        stream = await self._open("file_watch", {"path": path, "recursive": recursive}, limits=None,
                                  deadline=deadline)
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.EVENT and frame.meta.get("watching"):
                    return DirWatch(stream, path)
        except BaseException:
            await self._abandon(stream)
            raise

    async def list_processes(self) -> list[ProcessInfo]:
        meta = (await self._call("proc_list")).meta
        return [ProcessInfo.from_meta(p) for p in meta.get("processes", [])]

    async def wait_process(self, pid: int, timeout: float | None = None) -> ProcessInfo:  # noqa: ASYNC109
        """Wait for the process to end, at most ``timeout`` seconds (enforced by the guest); a guest that
        stops answering fails the wait with ``guest_timeout`` (without a timeout, health is probed while it
        waits; with one, the deadline bounds the wait, as for :meth:`exec`)."""
        deadline = self._deadline(None if timeout is None else timeout + self.deadlines.exec_grace)
        stream = await self._open("proc_wait", {"pid": pid, "timeout": timeout}, limits={},
                                  deadline=self._deadline(self.deadlines.call))
        try:
            while True:
                frame = await self._next(stream, deadline, probe=deadline is None)
                if frame.kind == Kind.RESULT:
                    return ProcessInfo.from_meta(frame.meta)
        finally:
            await self._abandon(stream)

    async def kill_process(self, pid: int, signal: int = 15) -> ProcessInfo:
        return ProcessInfo.from_meta((await self._call("proc_kill", {"pid": pid, "signal": signal})).meta)

    async def process_output(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> ProcessOutput:
        """What the guest kept of the process's output (at most PROCESS_OUTPUT_KEPT bytes per stream)."""
        deadline = loop_time() + self.deadlines.call
        stream = await self._open("proc_output", {"pid": pid, "stdout_from": stdout_from,
                                                   "stderr_from": stderr_from},
                                  limits={"stdout": PROCESS_OUTPUT_KEPT, "stderr": PROCESS_OUTPUT_KEPT},
                                  deadline=deadline)
        out = {"stdout": bytearray(), "stderr": bytearray()}
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.DATA and frame.meta.get("ch") in out:
                    out[frame.meta["ch"]] += frame.data
                elif frame.kind == Kind.RESULT:
                    m = frame.meta
                    return ProcessOutput(
                        stdout=bytes(out["stdout"]), stderr=bytes(out["stderr"]),
                        stdout_truncated=bool(m.get("stdout_truncated")),
                        stderr_truncated=bool(m.get("stderr_truncated")),
                        running=bool(m.get("running")), exit_code=_opt_int(m.get("exit_code")),
                        signal=_opt_int(m.get("signal")), stdout_end=int(m.get("stdout_end", 0)),
                        stderr_end=int(m.get("stderr_end", 0)),
                    )
        finally:
            await self._abandon(stream)

    async def pty_open(self, cmd: str | Sequence[str] | None = None, rows: int = 24, cols: int = 80,
                       env: dict[str, str] | None = None, *, cwd: str | None = None,
                       user: str | int | None = None) -> PtyHandle:
        args = {"cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd), "rows": rows, "cols": cols,
                "env": env, "cwd": cwd, "user": user}
        deadline = loop_time() + self.deadlines.idle
        stream = await self._open("pty_open", args, limits=None, deadline=deadline)
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.EVENT and frame.meta.get("started"):
                    return PtyHandle(stream, int(frame.meta["pid"]))
        except BaseException:
            await self._abandon(stream)
            raise

    async def tcp_open(self, port: int, *, connect_timeout: float = 10.0) -> TcpTunnel:
        """Connect to ``127.0.0.1:port`` inside the guest (``port_unreachable`` if nothing listens there)."""
        deadline = loop_time() + connect_timeout + self.deadlines.call
        stream = await self._open("tcp_open", {"port": port, "connect_timeout": connect_timeout},
                                  limits=None, deadline=deadline)
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.EVENT and frame.meta.get("connected"):
                    return TcpTunnel(stream, port)
                if frame.kind == Kind.RESULT:
                    raise GuestError("port_unreachable", f"port {port} closed the connection at once")
        except BaseException:
            await self._abandon(stream)
            raise

    async def read_file(self, path: str, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file, if it holds at most ``max_bytes`` (else ``too_large``; stream it with iter_file).
        The guest is asked for ``max_bytes + 1`` bytes; one that sends more fails with ``protocol_error``."""
        stream = await self._open("file_read", {"path": path, "length": max_bytes + 1},
                                  limits={None: max_bytes + 1}, deadline=self._deadline(self.deadlines.idle))
        out = bytearray()
        try:
            while True:
                frame = await self._next(stream, self._deadline(self.deadlines.idle))
                if frame.kind == Kind.DATA:
                    out += frame.data
                    if len(out) > max_bytes:
                        raise GuestError("too_large", f"{path} is larger than the {max_bytes} bytes "
                                                      "read_file collects")
                elif frame.kind == Kind.RESULT:
                    return bytes(out)
        finally:
            await self._abandon(stream)

    async def iter_file(self, path: str, chunk: int = CHUNK_SIZE) -> AsyncGenerator[bytes, None]:
        """The file's bytes as they arrive (guest chunks are at most 64 KiB; ``chunk`` caps them lower).
        Not capped: the caller consumes the stream, within the credit window."""
        idle = self.deadlines.idle
        stream = await self._open("file_read", {"path": path}, limits=None, deadline=self._deadline(idle))
        try:
            while True:
                frame = await self._next(stream, self._deadline(idle))
                if frame.kind == Kind.DATA:
                    data = frame.data
                    for i in range(0, len(data), max(1, chunk)):
                        yield data[i: i + chunk]
                elif frame.kind == Kind.RESULT:
                    return
        finally:
            await self._abandon(stream)

    async def write_file(self, path: str, data: bytes | AsyncIterable[bytes],
                         mode: int | None = None) -> FileInfo:
        """Write atomically (temporary file + rename); missing parent directories are created."""
        stream = await self._open("file_write", {"path": path, "mode": mode}, limits={},
                                  deadline=self._deadline(self.deadlines.idle))
        try:
            await stream.upload(data)
            return FileInfo.from_meta((await self._result(stream, self.deadlines.long_call)).meta)
        finally:
            await self._abandon(stream)

    async def list_dir(self, path: str) -> list[FileInfo]:
        """The directory's entries (the guest refuses a listing over MAX_LISTING_BYTES with too_large)."""
        deadline = loop_time() + self.deadlines.call
        stream = await self._open("file_list", {"path": path}, limits={None: MAX_LISTING_BYTES},
                                  deadline=deadline)
        raw = bytearray()
        try:
            while True:
                frame = await self._next(stream, deadline)
                if frame.kind == Kind.DATA:
                    raw += frame.data
                elif frame.kind == Kind.RESULT:
                    break
        finally:
            await self._abandon(stream)
        try:
            entries = json.loads(raw) if raw else []
            return [FileInfo.from_meta(e) for e in entries]
        except (ValueError, KeyError, TypeError) as exc:
            raise GuestError("protocol_error", f"guest sent a bad directory listing: {exc}") from None

    async def stat(self, path: str) -> FileInfo:
        return FileInfo.from_meta((await self._call("file_stat", {"path": path})).meta)

    async def mkdir(self, path: str, parents: bool = True, mode: int | None = None) -> FileInfo:
        return FileInfo.from_meta((await self._call("file_mkdir", {"path": path, "parents": parents,
                                                                     "mode": mode})).meta)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._call("file_remove", {"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str) -> None:
        await self._call("file_rename", {"src": src, "dst": dst})

    async def tar_export(self, path: str) -> AsyncGenerator[bytes, None]:
        """A tar stream (PAX format, uncompressed) of the directory's contents, or of one file."""
        idle = self.deadlines.idle
        stream = await self._open("tar_export", {"path": path}, limits=None, deadline=self._deadline(idle))
        try:
            while True:
                frame = await self._next(stream, self._deadline(idle))
                if frame.kind == Kind.DATA:
                    yield frame.data
                elif frame.kind == Kind.RESULT:
                    return
        finally:
            await self._abandon(stream)

    async def tar_import(self, path: str, data: bytes | AsyncIterable[bytes]) -> None:
        """Extract a tar stream (optionally gzip/bzip2/xz compressed) into the directory ``path``."""
        stream = await self._open("tar_import", {"path": path}, limits={},
                                  deadline=self._deadline(self.deadlines.idle))
        try:
            await stream.upload(data)
            await self._result(stream, self.deadlines.long_call)
        finally:
            await self._abandon(stream)

    async def set_clock(self, unix_ns: int | None = None) -> None:
        await self._call("set_clock", {"unix_ns": time.time_ns() if unix_ns is None else unix_ns})

    async def reseed(self, entropy: bytes | None = None) -> None:
        await self._call("reseed", data=os.urandom(64) if entropy is None else entropy)

    async def set_hostname(self, name: str) -> None:
        """Name the guest (identity is injected when a pooled sandbox is bound to a session)."""
        await self._call("set_hostname", {"name": name})

    async def set_aslr(self, enabled: bool) -> None:
        """Whether commands the guest spawns from now on get a randomized address-space layout."""
        await self._call("set_aslr", {"enabled": enabled})

    async def poweroff(self) -> None:
        """Ask the guest init to sync and power the VM off (only under the capsa init)."""
        await self._call("poweroff")

    async def close(self) -> None:
        if self._closed is None:
            self._fail_all(ChannelClosed("guest client closed"))
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> GuestClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

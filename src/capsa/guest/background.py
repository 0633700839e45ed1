"""Background processes (``proc_*``): started and left running, their output kept in ring buffers the
host polls or streams from offsets, stdin written on request, shared by every host connection."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections import OrderedDict
from typing import Any

from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.command import (
    DRAIN_IDLE,
    READ_SIZE,
    CommandSpec,
    grow_pipes,
    kill_everything,
    killpg,
    parse_command,
    reaped,
    spawn,
)
from capsa.guest.errors import OpError
from capsa.guest.protocol import PROCESS_OUTPUT_KEPT, Kind
from capsa.guest.results import ProcessInfo, exit_fields

__all__ = ["RING_SIZE", "ProcessTable", "RingBuffer"]

RING_SIZE = PROCESS_OUTPUT_KEPT


class RingBuffer:
    """The last ``size`` bytes of a stream, with absolute offsets so pollers can ask for 'new since'."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._size = size
        self._buf = bytearray()
        self.total = 0
        self._lock = threading.Lock()

    @property
    def start(self) -> int:
        return self.total - len(self._buf)

    def append(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            self.total += len(data)
            excess = len(self._buf) - self._size
            if excess > 0:
                del self._buf[:excess]

    def read(self, since: int = 0) -> tuple[bytes, int, int]:
        """Bytes from offset ``since`` (or the oldest kept), their start offset, and the end offset."""
        with self._lock:
            start = self.total - len(self._buf)
            begin = max(since, start)
            return bytes(self._buf[begin - start:]), begin, self.total


class BackgroundProcess:
    def __init__(self, spec: CommandSpec, proc: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.started_at = time.time()
        self.stdout = RingBuffer()
        self.stderr = RingBuffer()
        self.exited = threading.Event()
        self.changed = threading.Condition()
        """Notified when output arrives and when the process is reported exited (``proc_stream`` waits)."""
        self.stdin_lock = threading.Lock()
        self.returncode: int | None = None
        self.finished_at: float | None = None
        self._last_output = time.monotonic()
        self._collector = threading.Thread(target=self._collect, name=f"capsa-bg-{self.pid}", daemon=True)
        self._collector.start()
        threading.Thread(target=self._wait, name=f"capsa-bgwait-{self.pid}", daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ, self.stdout)
        sel.register(self.proc.stderr.fileno(), selectors.EVENT_READ, self.stderr)
        try:
            while sel.get_map():
                for key, _ in sel.select():
                    chunk = os.read(key.fd, READ_SIZE)
                    if chunk:
                        key.data.append(chunk)
                        self._last_output = time.monotonic()
                        with self.changed:
                            self.changed.notify_all()
                    else:
                        sel.unregister(key.fd)
        finally:
            sel.close()
            self.proc.stdout.close()
            self.proc.stderr.close()

    def _wait(self) -> None:
        returncode = self.proc.wait()
        reaped(self.proc)
        # Report the exit only once the output it wrote is collected, so "not running" means "all
        # output is there" -- unless descendants keep the pipes open and busy (then give up after a while).
        exited_at = time.monotonic()
        while self._collector.is_alive() and time.monotonic() < exited_at + 5.0:
            self._collector.join(0.05)
            if time.monotonic() - max(self._last_output, exited_at) > DRAIN_IDLE:
                break
        self.returncode = returncode
        self.finished_at = time.time()
        self.exited.set()
        with self.changed:
            self.changed.notify_all()
        with self.stdin_lock:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()

    def info(self) -> dict[str, Any]:
        """What the guest answers about the process (:class:`~capsa.guest.results.ProcessInfo`)."""
        ended = exit_fields(self.returncode if self.exited.is_set() else None)
        return ProcessInfo(pid=self.pid, cmd=self.spec.display, running=not self.exited.is_set(),
                           exit_code=ended["exit_code"], signal=ended["signal"], started_at=self.started_at,
                           finished_at=self.finished_at,
                           stdin_open=self.proc.stdin is not None and not self.proc.stdin.closed).to_meta()


class ProcessTable:
    """Background processes of this guest, shared by every host connection (they outlive them)."""

    KEEP_FINISHED = 256

    def __init__(self) -> None:
        self._procs: OrderedDict[int, BackgroundProcess] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, args: dict[str, Any]) -> BackgroundProcess:
        pid = args.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise OpError("bad_request", "pid must be an integer")
        with self._lock:
            proc = self._procs.get(pid)
        if proc is None:
            raise OpError("no_such_process", f"no background process with pid {pid}")
        return proc

    def _prune(self) -> None:
        finished = [pid for pid, p in self._procs.items() if p.exited.is_set()]
        for pid in finished[: max(0, len(finished) - self.KEEP_FINISHED)]:
            del self._procs[pid]

    def op_start(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        spec = parse_command(args)
        keep_stdin = args.get("stdin", False)
        if not isinstance(keep_stdin, bool):
            raise OpError("bad_request", "stdin must be a boolean")
        proc = spawn(spec, stdin=subprocess.PIPE if keep_stdin else subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        grow_pipes(proc)
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)  # proc_stdin waits with select, cancellable
        bg = BackgroundProcess(spec, proc)
        with self._lock:
            self._procs[bg.pid] = bg
            self._prune()
        stream.result(bg.info())

    def op_list(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        with self._lock:
            procs = list(self._procs.values())
        stream.result({"processes": [p.info() for p in procs]})

    def op_kill(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        proc = self._get(args)
        sig = args.get("signal", signal.SIGTERM)
        if isinstance(sig, bool) or not isinstance(sig, int) or not 0 < sig < signal.NSIG:
            raise OpError("bad_request", "signal must be a signal number")
        if not proc.exited.is_set():
            killpg(proc.pid, sig)
            # Give the process a moment so the answer usually shows it gone.
            proc.exited.wait(1.0)
        stream.result(proc.info())

    def op_output(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        proc = self._get(args)
        meta = proc.info()
        for name, ring in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            since = args.get(f"{name}_from", 0)
            if isinstance(since, bool) or not isinstance(since, int) or since < 0:
                raise OpError("bad_request", f"{name}_from must be a non-negative offset")
            chunk, begin, end = ring.read(since)
            meta[f"{name}_start"] = begin
            meta[f"{name}_end"] = end
            meta[f"{name}_truncated"] = begin > since
            if chunk:
                stream.send_data(chunk, {"ch": name})
        stream.result(meta)

    def op_stdin(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Write the request's inline data to the process's stdin (waits while the pipe is full)."""
        proc = self._get(args)
        with proc.stdin_lock:
            pipe = _open_stdin(proc)
            view = memoryview(data)
            while view:
                if stream.cancelled.is_set():
                    raise ChannelGone("request cancelled")
                if proc.exited.is_set():
                    raise OpError("process_exited", f"process {proc.pid} has exited")
                _, ready, _ = select.select([], [pipe], [], 0.2)
                if not ready:
                    continue
                try:
                    view = view[os.write(pipe.fileno(), view):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    raise OpError("stdin_closed", f"process {proc.pid} closed its stdin") from None
        stream.result(dict(proc.info(), bytes=len(data)))

    def op_close_stdin(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Close the process's stdin (it reads EOF). Closing it twice is not an error."""
        proc = self._get(args)
        with proc.stdin_lock:
            if proc.proc.stdin is None:
                raise OpError("stdin_closed", f"process {proc.pid} was started without stdin")
            with contextlib.suppress(OSError):
                proc.proc.stdin.close()
        stream.result(proc.info())

    def op_stream(self, stream: Stream, args: dict[str, Any], data: bytes) -> None:
        """Output from ``stdout_from``/``stderr_from`` as it is written, until the process has exited and
        every byte it wrote was sent. EVENT {"streaming"} first, then DATA meta ``{"ch", "offset"}`` (the
        chunk's first byte) and ``lost`` when the ring buffer no longer held bytes from the asked offset;
        RESULT = ProcessInfo + ``stdout_end``/``stderr_end``. The host cancelling ends it; the process
        keeps running."""
        proc = self._get(args)
        offsets: dict[str, int] = {}
        for name in ("stdout", "stderr"):
            since = args.get(f"{name}_from", 0)
            if isinstance(since, bool) or not isinstance(since, int) or since < 0:
                raise OpError("bad_request", f"{name}_from must be a non-negative offset")
            offsets[name] = since
        rings = (("stdout", proc.stdout), ("stderr", proc.stderr))
        stream.send(Kind.EVENT, {"streaming": True, "pid": proc.pid})
        while True:
            if stream.cancelled.is_set():
                raise ChannelGone("request cancelled")
            done = proc.exited.is_set()  # read before draining: output written before the exit is sent
            sent = False
            for name, ring in rings:
                chunk, begin, end = ring.read(offsets[name])
                if chunk:
                    meta: dict[str, Any] = {"ch": name, "offset": begin}
                    if begin > offsets[name]:
                        meta["lost"] = begin - offsets[name]
                    stream.send_data(chunk, meta)
                    sent = True
                offsets[name] = max(offsets[name], end)
            if done and not sent:
                break
            with proc.changed:
                if not proc.exited.is_set() and all(ring.total <= offsets[name] for name, ring in rings):
                    proc.changed.wait(0.5)
        stream.result(dict(proc.info(), stdout_end=offsets["stdout"], stderr_end=offsets["stderr"]))

    def kill_all(self) -> None:
        kill_everything()


def _open_stdin(proc: BackgroundProcess) -> Any:
    pipe = proc.proc.stdin
    if proc.exited.is_set():
        raise OpError("process_exited", f"process {proc.pid} has exited")
    if pipe is None:
        raise OpError("stdin_closed", f"process {proc.pid} was started without stdin (start it with stdin)")
    if pipe.closed:
        raise OpError("stdin_closed", f"the stdin of process {proc.pid} is closed")
    return pipe

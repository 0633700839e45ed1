"""The daemon's side of one host connection: frame writing, per-request streams, credit.

Every request runs in its own thread with a :class:`Stream`; the connection's reader thread only
routes frames and never blocks on a slow request (inbound data is bounded by the credit the
request has granted, so routing into an unbounded queue is still bounded memory).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from capsa.guest.errors import OpError, from_os_error
from capsa.guest.protocol import (
    CHUNK_SIZE,
    HELLO_EVENT,
    INITIAL_WINDOW,
    INSTANCE_KEY,
    PROTOCOL_VERSION,
    UNAVAILABLE,
    Frame,
    Kind,
    encode_frame,
)

__all__ = ["WORKERS", "ChannelGone", "Connection", "Stream", "StreamReader", "Workers"]


class ChannelGone(Exception):
    """The host this stream belonged to went away, or the request was cancelled."""


_END = object()


class Stream:
    """One request: its inbound frames and its outbound sends, with flow control both ways."""

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.inbox: queue.SimpleQueue[Frame | object] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self._cond = threading.Condition()
        self._send_credit = INITIAL_WINDOW
        self._recv_allowed = INITIAL_WINDOW  # bytes the host may still send us
        self._recv_lock = threading.Lock()  # _recv_allowed moves on the reader and the request thread
        self._recv_unacked = 0  # consumed bytes not yet returned as credit
        self._cancel_hooks: list[Callable[[], None]] = []
        self.finished = False

    # -- host -> guest ---------------------------------------------------------------------------

    def deliver(self, frame: Frame) -> None:
        """Called by the reader thread; must not block."""
        if frame.kind == Kind.WINDOW:
            n = frame.meta.get("n")
            if isinstance(n, int) and 0 < n <= 1 << 40:
                with self._cond:
                    self._send_credit += n
                    self._cond.notify_all()
            return
        if frame.kind == Kind.CANCEL:
            self.cancel()
            return
        if frame.kind == Kind.DATA:
            with self._recv_lock:
                self._recv_allowed -= len(frame.data)
                overrun = self._recv_allowed < 0
            if overrun:
                # Answer right away (the request's own thread may be blocked elsewhere), then stop it.
                with contextlib.suppress(ChannelGone):
                    self.error("flow_control", "host sent more data than the window allows")
                self.cancel()
                return
        self.inbox.put(frame)

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        self.inbox.put(_END)
        with self._cond:
            self._cond.notify_all()
        for hook in list(self._cancel_hooks):
            try:
                hook()
            except Exception as exc:  # a hook failing must not stop the others
                print(f"capsa-guest: cancel hook failed: {exc!r}", file=sys.stderr)

    def stop_inbox(self) -> None:
        """Wake whoever waits for inbound frames: the request is over."""
        self.inbox.put(_END)

    def on_cancel(self, hook: Callable[[], None]) -> None:
        self._cancel_hooks.append(hook)
        if self.cancelled.is_set():
            hook()

    def next_frame(self, timeout: float | None = None) -> Frame | None:
        """The next inbound DATA/END/EVENT frame; None on timeout. Raises when cancelled."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, OpError):
            raise item
        if not isinstance(item, Frame):
            raise ChannelGone("request cancelled")
        return item

    def frames(self) -> Iterator[Frame]:
        """Inbound DATA/END/EVENT frames as they come; raises like :meth:`next_frame` when cancelled."""
        while True:
            frame = self.next_frame()
            if frame is not None:
                yield frame

    def consumed(self, n: int) -> None:
        """Return credit for ``n`` inbound bytes the request has used up."""
        self._recv_unacked += n
        if self._recv_unacked >= INITIAL_WINDOW // 4:
            grant, self._recv_unacked = self._recv_unacked, 0
            with self._recv_lock:
                self._recv_allowed += grant
            self.send(Kind.WINDOW, {"n": grant})

    def reader(self) -> StreamReader:
        return StreamReader(self)

    # -- guest -> host ---------------------------------------------------------------------------

    def send(self, kind: Kind, meta: dict[str, Any] | None = None, data: bytes = b"") -> None:
        if self.finished:
            raise ChannelGone("stream already finished")
        self.conn.send_frame(encode_frame(kind, self.id, meta, data))

    def send_data(self, data: bytes | bytearray | memoryview, meta: dict[str, Any] | None = None) -> None:
        """Send ``data`` as DATA frames, waiting for credit; raises ChannelGone when cancelled."""
        view = memoryview(data)
        while view:
            with self._cond:
                while self._send_credit <= 0 and not self.cancelled.is_set() and not self.conn.closed:
                    self._cond.wait(1.0)
                if self.cancelled.is_set() or self.conn.closed:
                    raise ChannelGone("request cancelled")
                n = min(len(view), CHUNK_SIZE, self._send_credit)
                self._send_credit -= n
            self.send(Kind.DATA, meta, bytes(view[:n]))
            view = view[n:]

    def result(self, meta: dict[str, Any] | None = None, data: bytes = b"") -> None:
        self._finish(Kind.RESULT, meta or {}, data)

    def error(self, code: str, message: str) -> None:
        self._finish(Kind.ERROR, {"code": code, "message": message}, b"")

    def _finish(self, kind: Kind, meta: dict[str, Any], data: bytes) -> None:
        if self.finished:
            return
        try:
            self.send(kind, meta, data)
        finally:
            self.finished = True
            self.stop_inbox()
            self.conn.forget(self)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class StreamReader:
    """A read-only binary file over a stream's inbound DATA frames, ending at END."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._eof = False
        self.total = 0

    def _next_data(self) -> bytes:
        """The next non-empty DATA frame's bytes (counted, and credited back to the host); b"" at END."""
        while not self._eof:
            frame = self._stream.next_frame()
            if frame is None:
                continue
            if frame.kind == Kind.END:
                self._eof = True
            elif frame.kind == Kind.DATA and frame.data:
                self.total += len(frame.data)
                self._stream.consumed(len(frame.data))
                return frame.data
            elif frame.kind == Kind.ERROR:
                raise OpError("cancelled", f"host aborted the upload: {frame.message}")
        return b""

    def _fill(self) -> bool:
        data = self._next_data()
        self._buf += data
        return bool(data)

    def chunk(self) -> bytes:
        """The next piece of the body as it arrived (b"" at the end), without extra copies."""
        if self._buf:
            out = bytes(self._buf)
            self._buf.clear()
            return out
        return self._next_data()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            while self._fill():
                pass
            out = bytes(self._buf)
            self._buf.clear()
            return out
        while len(self._buf) < n and self._fill():
            pass
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def readable(self) -> bool:
        return True


Handler = Callable[[Stream, dict[str, Any], bytes], None]


class Connection:
    """One connected host. ``write`` must write all bytes or raise OSError."""

    def __init__(self, write: Callable[[bytes], None], dispatch: Callable[[str], Handler | None],
                 max_streams: int = 512, *, instance: str = "") -> None:
        self._write = write
        self.instance = instance
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        self._streams_lock = threading.Lock()
        self._max_streams = max_streams
        self.closed = False

    def send_frame(self, raw: bytes) -> None:
        if self.closed:
            raise ChannelGone("host disconnected")
        with self._lock:
            if self.closed:
                raise ChannelGone("host disconnected")
            try:
                self._write(raw)
            except OSError as exc:
                self.close()
                raise ChannelGone(f"write to host failed: {exc}") from exc

    def forget(self, stream: Stream) -> None:
        with self._streams_lock:
            if self._streams.get(stream.id) is stream:
                del self._streams[stream.id]

    def close(self) -> None:
        """The host is gone: cancel every request bound to this connection."""
        self.closed = True
        with self._streams_lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.cancel()

    def announce(self, **extra: Any) -> None:
        """Send the hello (see the protocol module): which daemon instance serves this connection."""
        meta = {"event": HELLO_EVENT, INSTANCE_KEY: self.instance, "protocol": PROTOCOL_VERSION, **extra}
        with contextlib.suppress(ChannelGone):
            self.send_frame(encode_frame(Kind.EVENT, 0, meta))

    def _reply_error(self, stream_id: int, code: str, message: str, **extra: Any) -> None:
        with contextlib.suppress(ChannelGone):
            self.send_frame(encode_frame(Kind.ERROR, stream_id, {"code": code, "message": message, **extra}))

    def handle(self, frame: Frame) -> None:
        """Route one decoded frame. Runs on the reader thread: never blocks, never raises."""
        with self._streams_lock:
            stream = self._streams.get(frame.stream)
        if frame.malformed:
            # Tell the host which of its requests (if any) we could not read, and drop that request:
            # part of its input is lost.
            self._reply_error(frame.stream, frame.code, frame.message)
            if stream is not None:
                stream.cancel()
                self.forget(stream)
            return
        if frame.kind == Kind.REQUEST:
            self._start(frame, stream)
            return
        if stream is not None:
            stream.deliver(frame)
        elif frame.kind == Kind.ERROR:
            print(f"capsa-guest: host reported on stream {frame.stream}: {frame.code}: {frame.message}",
                  file=sys.stderr)
        # Frames for finished streams (late stdin, a cancel after the result) are normal: dropped.

    def _start(self, frame: Frame, existing: Stream | None) -> None:
        if frame.stream == 0:
            self._reply_error(0, "bad_request", "requests need a non-zero stream id")
            return
        if existing is not None:
            self._reply_error(frame.stream, "bad_request", f"stream {frame.stream} is already in use")
            return
        op = frame.meta.get("op")
        if not isinstance(op, str):
            self._reply_error(frame.stream, "bad_request", "request meta needs a string 'op'")
            return
        wanted = frame.meta.get(INSTANCE_KEY)
        if self.instance and wanted is not None and wanted != self.instance:
            # Meant for a daemon instance that died (PID 1 restarted us): refuse it unrun, and say who we are.
            self._reply_error(frame.stream, UNAVAILABLE,
                              f"the guest daemon restarted (instance {str(wanted)[:64]!r} is gone); "
                              f"the request was not run", **{INSTANCE_KEY: self.instance})
            return
        handler = self._dispatch(op)
        if handler is None:
            self._reply_error(frame.stream, "unknown_op", f"unknown operation {op!r}")
            return
        with self._streams_lock:
            if len(self._streams) >= self._max_streams:
                too_many = True
            else:
                too_many = False
                stream = Stream(self, frame.stream)
                self._streams[frame.stream] = stream
        if too_many:
            self._reply_error(frame.stream, "too_many_requests",
                              f"more than {self._max_streams} concurrent requests")
            return
        args = {k: v for k, v in frame.meta.items() if k not in ("op", INSTANCE_KEY)}
        WORKERS.submit(_run, handler, stream, args, frame.data, f"capsa-{op}-{frame.stream}")


class Workers:
    """Threads that run requests: an idle one takes the next request, a new one starts only when none is
    idle (a request may block for as long as its command runs, so there is no upper bound here: the
    connection's stream cap is the bound). Starting a thread costs a few milliseconds in an emulated
    guest, on every request before this. Idle workers block on the queue without a timeout, so they
    never wake an idle guest; beyond ``keep_idle`` of them, a worker that finishes exits.

    Hand-written: concurrent.futures.ThreadPoolExecutor's workers are not daemon threads (the
    interpreter would wait at exit for requests blocked on commands) and it caps the worker count."""

    def __init__(self, keep_idle: int = 8) -> None:
        self._keep_idle = keep_idle
        self._idle = 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put((fn, args))
                return
        threading.Thread(target=self._work, args=(fn, args), daemon=True).start()

    def _work(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        while True:
            fn(*args)
            with self._lock:
                if self._idle >= self._keep_idle:
                    return
                self._idle += 1
            fn, args = self._jobs.get()


WORKERS = Workers()


def _run(handler: Handler, stream: Stream, args: dict[str, Any], data: bytes, name: str) -> None:
    threading.current_thread().name = name
    try:
        handler(stream, args, data)
        if not stream.finished:
            stream.result({})
    except ChannelGone:
        if not stream.conn.closed and not stream.finished:
            with contextlib.suppress(ChannelGone):
                stream.error("cancelled", "request cancelled")
    except OpError as exc:
        _safe_error(stream, exc.code, exc.message)
    except OSError as exc:
        err = from_os_error(exc)
        _safe_error(stream, err.code, err.message)
    except Exception as exc:  # the daemon must survive any bug in one handler
        print(f"capsa-guest: {name} crashed: {exc!r}", file=sys.stderr)
        _safe_error(stream, "internal_error", f"{type(exc).__name__}: {exc}")
    finally:
        stream.conn.forget(stream)


def _safe_error(stream: Stream, code: str, message: str) -> None:
    if stream.cancelled.is_set() and code not in ("flow_control",):
        code, message = "cancelled", "request cancelled"
    with contextlib.suppress(ChannelGone):
        stream.error(code, message[:4000])

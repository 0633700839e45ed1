"""The guest channel's plumbing: one reader task, frames routed to per-call streams, calls bounded.

One reader task decodes frames and routes them to per-request streams (:class:`CallStream`, which also
holds the flow control). A lost connection fails every pending call at once with :class:`ChannelClosed`.

A guest daemon that dies (a user command ran ``kill -9 -1``) does not close the connection: QEMU's
host side of a virtio-serial port does not see the guest closing it. The guest's PID 1 restarts the
daemon, and the new instance announces itself with a hello naming a fresh instance id (see
:mod:`capsa.guest.protocol`); the connection then fails every call in flight at once with
:class:`GuestUnavailable` (``guest_unavailable``) and addresses later requests to the new instance.
Requests that were still on their way to the dead one are refused unrun by its successor, with the
same error.

A hostile guest (its root is the tenant's) is bounded two more ways:

* **Bytes per call.** Every result the client collects has a cap taken from the operation's own limit
  (the call's :data:`~capsa.node.guestlink.streams.Limits`, see :mod:`capsa.node.guestlink.client`), and
  no DATA at all for the one-frame answers (stat, proc_list, ...). At most
  :data:`~capsa.node.guestlink.streams.MAX_EVENTS_PER_CALL` EVENT frames per call. Streamed results
  (``iter_file``, ``tar_export``, a terminal) go to the caller as they arrive, within the credit window,
  and are not capped. A guest past a cap fails that call with ``protocol_error`` at the frame that
  crosses it (nothing more is buffered); the connection sends CANCEL, drops the stream's later frames and
  stays usable for other calls. The sandbox is not failed: a guest can only break its own sandbox's calls.
* **Time per call.** Every call has a deadline (:class:`GuestDeadlines`): one-frame answers
  ``call``, slow file operations ``long_call``, streamed phases ``idle`` between frames or credit,
  exec its own timeout + ``exec_grace``; while an exec is silent for ``probe_interval`` the connection
  asks the guest for ``health``, so a guest that stopped answering fails a command without a timeout
  too. Past a deadline the call fails with :class:`GuestTimeout` (``guest_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from typing import Any, Self

from capsa.guest.protocol import INSTANCE_KEY, UNAVAILABLE, Decoder, Frame, Kind, encode_frame, hello_instance
from capsa.node.guestlink.errors import ChannelClosed, GuestError, GuestTimeout, GuestUnavailable
from capsa.node.guestlink.streams import CallStream, GuestDeadlines, Limits, loop_time

__all__ = ["READ_SIZE", "GuestConnection"]

READ_SIZE = 256 * 1024

_LONG_OPS = frozenset({"file_remove", "file_rename", "poweroff"})


class GuestConnection:
    """Frames, routes and bounds the calls to one guest daemon over an asyncio stream pair (the operations
    are :class:`~capsa.node.guestlink.client.GuestClient`'s). Use from a single event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 deadlines: GuestDeadlines | None = None) -> None:
        self.deadlines = deadlines or GuestDeadlines()
        """How long calls wait for the guest; may be replaced (tests shorten them)."""
        self._reader = reader
        self._writer = writer
        self._decoder = Decoder()
        self._streams: dict[int, CallStream] = {}
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
                           deadlines: GuestDeadlines | None = None) -> Self:
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

    async def send(self, kind: Kind, stream_id: int, meta: dict[str, Any] | None = None,
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

    def forget(self, stream: CallStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    async def request(self, op: str, args: dict[str, Any] | None = None, data: bytes = b"", *,
                    limits: Limits | None, deadline: float | None) -> CallStream:
        """Start a request whose answers are capped by ``limits``; sending it must finish by ``deadline``."""
        self._check_open()
        stream_id = self._next_id
        self._next_id = self._next_id + 1 if self._next_id < 0xFFFFFFF0 else 1
        stream = CallStream(self, stream_id, op, limits)
        self._streams[stream_id] = stream
        meta: dict[str, Any] = {"op": op}
        if args:
            meta.update({k: v for k, v in args.items() if v is not None})
        if self.instance is not None:
            meta[INSTANCE_KEY] = self.instance
        try:
            async with asyncio.timeout_at(deadline):
                await self.send(Kind.REQUEST, stream_id, meta, data)
        except TimeoutError:
            self.forget(stream)
            raise GuestTimeout(f"the guest took no {op} request for {self._budget(deadline)} s") from None
        except (ValueError, TypeError) as exc:  # too large, or not JSON: the caller's input
            self.forget(stream)
            raise GuestError("bad_request", f"cannot send {op} request: {exc}") from None
        except BaseException:
            self.forget(stream)
            raise
        return stream

    async def abandon(self, stream: CallStream) -> None:
        """The caller gave up (cancelled, timed out, broke out of a stream, past a cap): tell the guest."""
        if stream.done and stream.failure is None:
            self.forget(stream)
            return
        self.forget(stream)
        stream.done = True
        if self._closed is None:
            # Best effort: a guest that stopped reading its port must not hold the caller here either.
            with contextlib.suppress(ChannelClosed, OSError, TimeoutError):
                async with asyncio.timeout(self.deadlines.probe):
                    await asyncio.shield(self.send(Kind.CANCEL, stream.id))

    def deadline_in(self, seconds: float | None) -> float | None:
        return None if seconds is None else loop_time() + seconds

    def _budget(self, deadline: float | None) -> str:
        return "?" if deadline is None else f"{max(0.0, deadline - loop_time()):.3g}"

    async def next_frame(self, stream: CallStream, deadline: float | None, *, probe: bool = False) -> Frame:
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

    async def call(self, op: str, args: dict[str, Any] | None = None, data: bytes = b"",
                    timeout: float | None = None) -> Frame:  # noqa: ASYNC109
        """A request answered by one RESULT (no DATA), by ``timeout`` (default: the op's deadline)."""
        if timeout is None:
            timeout = self.deadlines.long_call if op in _LONG_OPS else self.deadlines.call
        deadline = loop_time() + timeout
        stream = await self.request(op, args, data, limits={}, deadline=deadline)
        try:
            while True:
                try:
                    frame = await self.next_frame(stream, deadline)
                except GuestTimeout:
                    raise GuestTimeout(f"guest did not answer {op} within {timeout:g} s") from None
                if frame.kind == Kind.RESULT:
                    return frame
        finally:
            await self.abandon(stream)

    async def result_frame(self, stream: CallStream, seconds: float) -> Frame:
        """Skip to the stream's RESULT, within ``seconds``."""
        deadline = loop_time() + seconds
        while True:
            frame = await self.next_frame(stream, deadline)
            if frame.kind == Kind.RESULT:
                return frame

    async def health(self, timeout: float = 5) -> dict[str, object]:  # noqa: ASYNC109
        meta = dict((await self.call("health", timeout=timeout)).meta)
        instance = meta.get(INSTANCE_KEY)
        if isinstance(instance, str) and instance:
            self._learn_instance(instance, "health named a new instance")
        return meta

    async def close(self) -> None:
        if self._closed is None:
            self._fail_all(ChannelClosed("guest client closed"))
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

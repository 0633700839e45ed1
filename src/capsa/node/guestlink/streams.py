"""One call on the guest channel: its flow control (credit windows both ways), caps and deadlines.

Inbound data per call is bounded by the credit window (the guest may not send more than we have
acknowledged, and we only acknowledge what the caller has consumed), so a slow consumer costs at most one
window of memory; a call's :data:`Limits` cap what it collects in all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from capsa.guest.protocol import CHUNK_SIZE, INITIAL_WINDOW, Frame, Kind
from capsa.node.guestlink.errors import GuestError, GuestTimeout

__all__ = [
    "EXEC_TIMEOUT_GRACE",
    "MAX_EVENTS_PER_CALL",
    "CallStream",
    "GuestDeadlines",
    "Limits",
    "Link",
    "loop_time",
]

# How long past its own timeout a command may take to be reported before the client gives up on the guest.
EXEC_TIMEOUT_GRACE = 60.0
# Data frames are bounded by the credit window; this bounds the small ones (events, empty data).
MAX_QUEUED_FRAMES = 4096
MAX_EVENTS_PER_CALL = 16
"""EVENT frames a call accepts (the daemon sends one, ``started``): their meta is not flow controlled."""


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
    """Past a command's own timeout (exec), which the guest enforces."""
    probe_interval: float = 30.0
    """An exec silent this long makes the client check the guest with health ..."""
    probe: float = 10.0
    """... which must answer within this; also the most a CANCEL may wait to be written."""


class Link(Protocol):
    """What a call's stream needs of the connection it runs on."""

    @property
    def deadlines(self) -> GuestDeadlines: ...

    async def send(self, kind: Kind, stream_id: int, meta: dict[str, Any] | None = None,
                   data: bytes = b"") -> None: ...


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


Limits = Mapping[str | None, int]
"""Bytes a call accepts per DATA channel (``meta["ch"]``, None for frames without one); a channel not
named accepts none. ``None`` instead of a mapping: the call streams to its caller and is not capped."""


class CallStream:
    """Client-side state of one request: what it may still send and receive, and what it received."""

    def __init__(self, link: Link, stream_id: int, op: str, limits: Limits | None) -> None:
        self.link = link
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
            await self.link.send(Kind.WINDOW, self.id, {"n": grant})

    async def send_data(self, data: bytes) -> bool:
        """Send within credit; returns False when the guest already finished the request. Waiting longer
        than the client's idle deadline for credit fails with GuestTimeout."""
        view = memoryview(data)
        while view:
            while self.send_credit <= 0 and not self.done:
                self.credit_changed.clear()
                idle = self.link.deadlines.idle
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
            await self.link.send(Kind.DATA, self.id, None, bytes(view[:n]))
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
            await self.link.send(Kind.END, self.id)

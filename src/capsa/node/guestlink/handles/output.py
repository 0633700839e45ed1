"""A background process's output as it is written (``proc_stream``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from capsa.guest.protocol import Kind
from capsa.guest.results import ProcessInfo, opt_int
from capsa.node.guestlink.connection import GuestConnection
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.streams import CallStream

__all__ = ["OutputChunk", "OutputStream", "StreamEnd"]


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


class OutputStream:
    """A background process's output as it is written (``proc_stream``), from given offsets to its exit.

    ``chunks()`` yields :class:`OutputChunk` and lastly one :class:`StreamEnd`; a process that stays silent
    is fine (the client checks the guest with health meanwhile). ``close()`` stops streaming; the process
    runs on."""

    def __init__(self, link: GuestConnection, stream: CallStream, pid: int) -> None:
        self._link = link
        self._stream = stream
        self.pid = pid
        self.closed = False

    async def chunks(self) -> AsyncGenerator[OutputChunk | StreamEnd, None]:
        try:
            while not self.closed:
                frame = await self._link.next_frame(self._stream, None, probe=True)
                if frame.kind == Kind.DATA:
                    ch = frame.meta.get("ch")
                    offset = opt_int(frame.meta.get("offset"))
                    if ch not in ("stdout", "stderr") or offset is None or offset < 0:
                        raise GuestError("protocol_error", "guest sent process output without channel/offset")
                    yield OutputChunk(str(ch), offset, frame.data, opt_int(frame.meta.get("lost")) or 0)
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
        await self._link.abandon(self._stream)

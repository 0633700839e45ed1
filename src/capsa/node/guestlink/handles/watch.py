"""A watched directory in the guest (``file_watch``): one JSON event per line."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from capsa.guest.protocol import Kind
from capsa.guest.results import WatchEvent
from capsa.node.guestlink.connection import GuestConnection
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.streams import CallStream

__all__ = ["DirWatch"]


class DirWatch:
    """A watched directory (``file_watch``): ``events()`` until ``close()`` or the directory is removed."""

    MAX_LINE = 64 * 1024

    def __init__(self, link: GuestConnection, stream: CallStream, path: str) -> None:
        self._link = link
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
        await self._link.abandon(self._stream)


def _watch_event(line: bytes) -> WatchEvent:
    try:
        return WatchEvent.from_meta(json.loads(line))
    except (ValueError, KeyError, TypeError) as exc:
        raise GuestError("protocol_error", f"guest sent a bad watch event: {exc!r}"[:200]) from None

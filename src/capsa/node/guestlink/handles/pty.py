"""A terminal in the guest (``pty_open``): input, resizes and signals up, output and the exit down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from capsa.guest.protocol import Kind
from capsa.guest.results import opt_int
from capsa.node.guestlink.connection import GuestConnection
from capsa.node.guestlink.errors import ChannelClosed, GuestError
from capsa.node.guestlink.streams import CallStream

__all__ = ["PtyHandle"]


class PtyHandle:
    """An open terminal in the guest."""

    def __init__(self, link: GuestConnection, stream: CallStream, pid: int) -> None:
        self._link = link
        self._stream = stream
        self.pid = pid
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.closed = False

    async def write(self, data: bytes) -> None:
        if not await self._stream.send_data(data):
            raise GuestError("bad_request", "the terminal has exited")

    async def resize(self, cols: int, rows: int) -> None:
        await self._link.send(Kind.EVENT, self._stream.id, {"cols": cols, "rows": rows})

    async def send_signal(self, sig: int) -> None:
        """Signal the terminal's process group; the exit comes through :meth:`read` as usual."""
        await self._link.send(Kind.EVENT, self._stream.id, {"signal": sig})

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
        self.exit_code = opt_int(meta.get("exit_code"))
        self.signal = opt_int(meta.get("signal"))
        self.closed = True
        self._link.forget(self._stream)

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Hang up the terminal (SIGHUP to its processes) and wait for it to be gone."""
        if self.closed:
            return
        stream = self._stream
        with contextlib.suppress(ChannelClosed):
            await self._link.send(Kind.CANCEL, stream.id)
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
        self._link.forget(stream)

"""Waiting for a guest's background process to end, the way the node does: its output stream ends with
the exit (``proc_stream``), and ``proc_list`` says how it stands when a wait is given up."""

from __future__ import annotations

import asyncio
import contextlib

from capsa.guest.results import ProcessInfo
from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.handles.output import StreamEnd

__all__ = ["wait_exit"]


async def wait_exit(guest: GuestClient, pid: int, timeout: float | None = None) -> ProcessInfo:  # noqa: ASYNC109
    """The process's info once it exited, or (``timeout`` seconds passed first) as it stands then.
    An unknown pid raises ``no_such_process``."""
    output = await guest.stream_process(pid)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                async for item in output.chunks():
                    if isinstance(item, StreamEnd):
                        return item.info
    finally:
        await output.close()
    return next(p for p in await guest.list_processes() if p.pid == pid)

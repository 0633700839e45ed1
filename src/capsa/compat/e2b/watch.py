"""envd's directory watching on capsa's ``file_watch`` (:func:`capsa.control.process_io.watch_files`).

Two forms, as the SDKs use them: the async SDK keeps one ``WatchDir`` stream open; the sync SDK creates a
watcher (``CreateWatcher``) and polls it (``GetWatcherEvents``) until ``RemoveWatcher``. A watcher is a
task on this replica that reads the node's stream into a bounded buffer (:class:`Watchers`); it belongs
to one session, and only calls for that session (so only that tenant) reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from capsa.common.errors import CapsaError
from capsa.compat.e2b.access import EnvdTarget
from capsa.compat.e2b.connect import ConnectError, paced
from capsa.control import process_io
from capsa.control.plane import ControlPlane
from capsa.sdk.models import FileEvent, StreamError

__all__ = ["MAX_BUFFERED", "MAX_WATCHERS_PER_SESSION", "Watchers", "watch_stream"]

MAX_WATCHERS_PER_SESSION = 64
MAX_BUFFERED = 10_000
"""Events a watcher keeps between two polls; older ones are dropped."""
_TYPES = {"created": "EVENT_TYPE_CREATE", "modified": "EVENT_TYPE_WRITE", "removed": "EVENT_TYPE_REMOVE"}


def _event(root: str, event: FileEvent) -> dict[str, Any] | None:
    kind = _TYPES.get(event.type)
    if kind is None:  # overflow: E2B has no such event
        return None
    return {"name": posixpath.relpath(event.path, root), "type": kind}


async def _events(control: ControlPlane, target: EnvdTarget, path: str, recursive: bool,
                  ready: asyncio.Event | None = None, *, messages: bool = False,
                  ) -> AsyncIterator[dict[str, Any]]:
    """The watch's events (E2B ``FilesystemEvent``); ``messages``: as ``WatchDirResponse`` messages, a
    ``start`` first, once the watch is set up. ``ready`` is set then too."""
    stream = await process_io.watch_files(control, target.principal.tenant, target.row.id, path,
                                          recursive=recursive)
    try:
        if ready is not None:
            ready.set()
        if messages:
            yield {"start": {}}
        async for event in stream:
            if isinstance(event, StreamError):
                raise CapsaError(event.detail, code=event.code, status=502)
            converted = _event(path, event)
            if converted is not None:
                yield {"filesystem": converted} if messages else converted
    finally:
        await stream.aclose()


async def watch_stream(control: ControlPlane, target: EnvdTarget, path: str,
                       recursive: bool) -> AsyncIterator[Mapping[str, Any]]:
    """``WatchDir``: a start message once the watch is set up, then one per change, keepalives between."""
    async for message in paced(_events(control, target, path, recursive, messages=True), {"keepalive": {}}):
        yield message


@dataclass
class _Watcher:
    session_id: str
    task: asyncio.Task[None]
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_BUFFERED))
    error: BaseException | None = None


@dataclass
class Watchers:
    """The polled watchers this replica runs, by watcher id."""

    running: dict[str, _Watcher] = field(default_factory=dict)

    async def create(self, control: ControlPlane, target: EnvdTarget, path: str, recursive: bool) -> str:
        if sum(w.session_id == target.row.id for w in self.running.values()) >= MAX_WATCHERS_PER_SESSION:
            raise ConnectError("resource_exhausted",
                               f"at most {MAX_WATCHERS_PER_SESSION} watchers per sandbox")
        ready = asyncio.Event()
        watcher_id = "w_" + secrets.token_hex(12)
        events: deque[dict[str, Any]] = deque(maxlen=MAX_BUFFERED)

        async def run() -> None:
            async for event in _events(control, target, path, recursive, ready):
                events.append(event)

        task = asyncio.create_task(run(), name=f"e2b-watch-{watcher_id}")
        watcher = _Watcher(target.row.id, task, events)
        task.add_done_callback(lambda t: setattr(watcher, "error", None if t.cancelled() else t.exception()))
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():  # the watch was refused (no such directory, sandbox gone ...)
            error = task.exception() if not task.cancelled() else None
            raise error if isinstance(error, Exception) else ConnectError("internal", "watch ended")
        self.running[watcher_id] = watcher
        return watcher_id

    def _own(self, target: EnvdTarget, watcher_id: object) -> _Watcher:
        watcher = self.running.get(watcher_id) if isinstance(watcher_id, str) else None
        if watcher is None or watcher.session_id != target.row.id:
            raise ConnectError("not_found", f"watcher {watcher_id} not found")
        return watcher

    def drain(self, target: EnvdTarget, watcher_id: object) -> list[dict[str, Any]]:
        watcher = self._own(target, watcher_id)
        drained = list(watcher.events)
        watcher.events.clear()
        if not drained and watcher.error is not None:
            self.running.pop(str(watcher_id), None)
            error = watcher.error
            raise error if isinstance(error, Exception) else ConnectError("internal", "watch ended")
        return drained

    async def remove(self, target: EnvdTarget, watcher_id: object) -> None:
        watcher = self._own(target, watcher_id)
        self.running.pop(str(watcher_id), None)
        watcher.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher.task

    async def close(self) -> None:
        for watcher_id in list(self.running):
            watcher = self.running.pop(watcher_id)
            watcher.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher.task

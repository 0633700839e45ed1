"""envd's directory watching on capsa's ``file_watch``
(:func:`capsa.control.sessions.process_io.watch_files`).

Two forms, as the SDKs use them: the async SDK keeps one ``WatchDir`` stream open; the sync SDK creates a
watcher (``CreateWatcher``) and polls it (``GetWatcherEvents``) until ``RemoveWatcher``. A watcher is a
task on this replica that reads the node's stream into a buffer (:class:`Watchers`); it belongs to one
session, and only calls for that session (so only that tenant) reach it.

Polled watchers are bounded (:class:`WatchLimits`, ``CAPSA_E2B_WATCHER*``): the bytes buffered per watcher
and on the replica, watchers per session and per tenant. A watcher whose buffer would pass a bound is
stopped and its buffer freed; its next poll answers ``resource_exhausted`` (as envd reports a watcher's
failure: the error instead of the events), so events are never dropped silently. A watcher whose stream
ends (directory removed, node lost) frees its buffer at once and answers its error on the next poll; one
whose session ended is dropped; one not polled for ``e2b_watcher_unpolled_seconds`` is dropped. Its open
stream does not keep the session active: polls do (each is a call on the running session).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from capsa.common.errors import CapsaError
from capsa.common.wire.streams import FileEvent, StreamError
from capsa.compat.e2b.access import EnvdTarget
from capsa.compat.e2b.connect import ConnectError, as_connect, paced
from capsa.control.plane import ControlPlane
from capsa.control.sessions import process_io
from capsa.control.sessions import service as sessions
from capsa.control.settings import ControlSettings

__all__ = ["MAX_WATCHERS_PER_SESSION", "WatchLimits", "Watchers", "event_cost", "watch_stream"]

MAX_WATCHERS_PER_SESSION = 64
_SLOT_BYTES = 64
"""What a buffered event costs beside its name: its tuple (56 bytes) and its slot in the deque."""
_TYPES = {"created": "EVENT_TYPE_CREATE", "modified": "EVENT_TYPE_WRITE", "removed": "EVENT_TYPE_REMOVE"}


async def _messages(control: ControlPlane, target: EnvdTarget, path: str, recursive: bool,
                    ) -> AsyncIterator[dict[str, Any]]:
    """The watch as ``WatchDirResponse`` messages: a ``start`` once the watch is set up, then its
    events (E2B ``FilesystemEvent``)."""
    stream = await process_io.watch_files(control, target.principal.tenant, target.id, path,
                                          recursive=recursive)
    try:
        yield {"start": {}}
        async for event in stream:
            if isinstance(event, StreamError):
                raise CapsaError(event.detail, code=event.code, status=502)
            kind = _TYPES.get(event.type)
            if kind is not None:  # else overflow: E2B has no such event
                yield {"filesystem": {"name": posixpath.relpath(event.path, path), "type": kind}}
    finally:
        await stream.aclose()


async def watch_stream(control: ControlPlane, target: EnvdTarget, path: str,
                       recursive: bool) -> AsyncIterator[Mapping[str, Any]]:
    """``WatchDir``: a start message once the watch is set up, then one per change, keepalives between."""
    async for message in paced(_messages(control, target, path, recursive), {"keepalive": {}}):
        yield message


def event_cost(name: str) -> int:
    """The bytes one buffered event holds: its name (a ``str``) and its slot; its type is shared."""
    return sys.getsizeof(name) + _SLOT_BYTES


@dataclass(frozen=True)
class WatchLimits:
    """The bounds on polled watchers (settings ``e2b_watcher_*``)."""

    watcher_bytes: int
    replica_bytes: int
    per_tenant: int
    unpolled_seconds: float
    per_session: int = MAX_WATCHERS_PER_SESSION

    @classmethod
    def of(cls, settings: ControlSettings) -> WatchLimits:
        return cls(settings.e2b_watcher_max_bytes, settings.e2b_watchers_max_bytes,
                   settings.e2b_watchers_per_tenant, settings.e2b_watcher_unpolled_seconds)


@dataclass(eq=False)
class _Watcher:
    id: str
    session_id: str
    sandbox_id: str
    tenant: str
    root: str
    events: deque[tuple[str, str]] = field(default_factory=deque)
    """(name relative to ``root``, E2B event type) since the last poll."""
    held: int = 0
    """Bytes of ``events`` (:func:`event_cost`)."""
    error: ConnectError | None = None
    """Why the watch stopped: the next poll answers it."""
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None


async def _sandbox_runs(control: ControlPlane, watcher: _Watcher) -> bool:
    """Whether the watcher's session still runs on the sandbox it was made on (else it ended, paused or
    moved, and its watch with it)."""
    return await sessions.runs_on(control, watcher.session_id, watcher.sandbox_id)


@dataclass
class Watchers:
    """The polled watchers this replica runs, by watcher id, and the bytes their buffers hold."""

    running: dict[str, _Watcher] = field(default_factory=dict)
    held: int = 0
    """Bytes buffered by every watcher on this replica (at most ``limits.replica_bytes``)."""
    limits: WatchLimits | None = None
    """Read from the plane's settings at the first ``create``."""

    def _limits(self, control: ControlPlane) -> WatchLimits:
        if self.limits is None:
            self.limits = WatchLimits.of(control.settings)
        return self.limits

    def _check_room(self, target: EnvdTarget, limits: WatchLimits) -> None:
        watchers = list(self.running.values())
        if sum(w.session_id == target.id for w in watchers) >= limits.per_session:
            raise ConnectError("resource_exhausted", f"at most {limits.per_session} watchers per sandbox")
        if sum(w.tenant == target.principal.tenant for w in watchers) >= limits.per_tenant:
            raise ConnectError("resource_exhausted", f"at most {limits.per_tenant} watchers per tenant "
                                                     "(remove some with RemoveWatcher)")

    async def create(self, control: ControlPlane, target: EnvdTarget, path: str, recursive: bool) -> str:
        limits = self._limits(control)
        self._check_room(target, limits)
        # Refusals (no such directory, sandbox gone ...) raise here, before anything is kept.
        stream = await process_io.watch_files(control, target.principal.tenant, target.id, path,
                                              recursive=recursive, active=False)
        try:
            self._check_room(target, limits)  # again: other creates may have finished meanwhile
        except ConnectError:
            await stream.aclose()
            raise
        watcher = _Watcher("w_" + secrets.token_hex(12), target.id, target.sandbox_id,
                           target.principal.tenant, path)
        self.running[watcher.id] = watcher
        watcher.task = asyncio.create_task(self._run(control, watcher, stream, limits),
                                           name=f"e2b-watch-{watcher.id}")
        self._arm(watcher, limits)
        return watcher.id

    async def _run(self, control: ControlPlane, watcher: _Watcher,
                   stream: process_io.EventStream[FileEvent | StreamError], limits: WatchLimits) -> None:
        try:
            async for event in stream:
                if isinstance(event, StreamError):
                    raise CapsaError(event.detail, code=event.code, status=502)
                kind = _TYPES.get(event.type)
                if kind is None:  # overflow: E2B has no such event
                    continue
                name = posixpath.relpath(event.path, watcher.root)
                cost = event_cost(name)
                if watcher.held + cost > limits.watcher_bytes:
                    raise ConnectError("resource_exhausted", (
                        f"watcher {watcher.id} stopped: the events since its last poll passed "
                        f"{limits.watcher_bytes} bytes; later events are lost (poll more often, or watch "
                        "a narrower directory)"))
                if self.held + cost > limits.replica_bytes:
                    raise ConnectError("resource_exhausted", (
                        f"watcher {watcher.id} stopped: this server's watchers hold {limits.replica_bytes} "
                        "bytes of unpolled events; later events are lost"))
                watcher.events.append((name, kind))
                watcher.held += cost
                self.held += cost
            raise ConnectError("unavailable", f"the watch of {watcher.root} ended")
        except Exception as exc:  # the watch is over: free its buffer, keep only why
            self._release(watcher)
            watcher.error = as_connect(exc)
            await stream.aclose()
            if not await _sandbox_runs(control, watcher):
                self._discard(watcher.id)  # its session ended: no poll can reach it
        finally:
            await stream.aclose()

    def _release(self, watcher: _Watcher) -> None:
        self.held -= watcher.held
        watcher.held = 0
        watcher.events.clear()

    def _arm(self, watcher: _Watcher, limits: WatchLimits) -> None:
        """(Re)start the watcher's unpolled clock: without a poll for that long, it is dropped."""
        if watcher.timer is not None:
            watcher.timer.cancel()
        watcher.timer = asyncio.get_running_loop().call_later(limits.unpolled_seconds, self._discard,
                                                              watcher.id)

    def _discard(self, watcher_id: str) -> _Watcher | None:
        """Forget the watcher now: its buffer, its clock, and its stream (the task closes it)."""
        watcher = self.running.pop(watcher_id, None)
        if watcher is None:
            return None
        self._release(watcher)
        if watcher.timer is not None:
            watcher.timer.cancel()
        task = watcher.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        return watcher

    def _own(self, target: EnvdTarget, watcher_id: object) -> _Watcher:
        watcher = self.running.get(watcher_id) if isinstance(watcher_id, str) else None
        if watcher is None or watcher.session_id != target.id:
            raise ConnectError("not_found", f"watcher {watcher_id} not found")
        return watcher

    def drain(self, target: EnvdTarget, watcher_id: object) -> list[dict[str, Any]]:
        """The events since the last poll; a stopped watcher answers why it stopped (once) instead."""
        watcher = self._own(target, watcher_id)
        if watcher.error is not None:
            self._discard(watcher.id)
            raise watcher.error
        drained = [{"name": name, "type": kind} for name, kind in watcher.events]
        self._release(watcher)
        assert self.limits is not None
        self._arm(watcher, self.limits)
        return drained

    async def remove(self, target: EnvdTarget, watcher_id: object) -> None:
        await self._stop(self._discard(self._own(target, watcher_id).id))

    async def close(self) -> None:
        for watcher_id in list(self.running):
            await self._stop(self._discard(watcher_id))

    @staticmethod
    async def _stop(watcher: _Watcher | None) -> None:
        if watcher is not None and watcher.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher.task

"""One running QEMU microvm: its guest channel, its watcher, and how it stops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import ChannelClosed
from capsa.node.runtime.base import Accelerator, FailureCallback, SandboxFailed, SandboxState, VMSpec
from capsa.node.runtime.qemu.agent_socket import connect_agent
from capsa.node.runtime.qemu.process import BACKGROUND_NICE, QemuProcess
from capsa.node.runtime.qemu.storage import VmFiles
from capsa.node.runtime.workdir import VmDir

__all__ = ["QemuSandbox"]

_log = logging.getLogger(__name__)


class _GuestProxy:
    """The sandbox's GuestClient, except that a dead VM raises SandboxFailed instead of hanging or a bare
    ChannelClosed, calls on a FAILED sandbox fail at once, and a channel lost while QEMU still runs is
    reconnected on the next call."""

    def __init__(self, sandbox: QemuSandbox) -> None:
        self._sandbox = sandbox

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._sandbox._client, name)
        if inspect.iscoroutinefunction(target):
            return functools.partial(self._call, name)
        if inspect.isasyncgenfunction(target):
            return functools.partial(self._iterate, name)
        return target

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        client = await self._sandbox._usable_client()
        try:
            return await getattr(client, name)(*args, **kwargs)
        except ChannelClosed as exc:
            raise await self._sandbox._channel_error(exc) from exc

    async def _iterate(self, name: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        client = await self._sandbox._usable_client()
        try:
            async for item in getattr(client, name)(*args, **kwargs):
                yield item
        except ChannelClosed as exc:
            raise await self._sandbox._channel_error(exc) from exc


class QemuSandbox:
    """One QEMU microvm (implements :class:`capsa.node.runtime.base.Sandbox`).

    ``spec`` is what it was started as, ``files`` where its disk and RAM live, ``parent`` the snapshot its
    state descends from (None for a cold boot)."""

    def __init__(self, sandbox_id: str, spec: VMSpec, vmdir: VmDir, files: VmFiles, process: QemuProcess,
                 client: GuestClient, accel: Accelerator, *, vm_uid: int | None, boot_seconds: float,
                 parent: str | None = None) -> None:
        self.id = sandbox_id
        self.spec = spec
        self._vmdir = vmdir
        self.files = files
        self.process = process
        self._client = client
        self.accelerator = accel
        self.vm_uid = vm_uid
        self.boot_seconds = boot_seconds
        self.parent = parent
        self._state = SandboxState.RUNNING
        self._failure: str | None = None
        self._callbacks: list[FailureCallback] = []
        self._stopping = False
        self._lock = asyncio.Lock()
        self._reconnect_lock = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._exited = asyncio.Event()
        self._proxy = _GuestProxy(self)

    @property
    def state(self) -> SandboxState:
        return self._state

    @property
    def guest(self) -> GuestClient:
        return cast(GuestClient, self._proxy)

    @property
    def workdir(self) -> Path:
        return self._vmdir.root

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def console_tail(self, limit: int = 4000) -> str:
        return self.process.console_tail(limit)

    def on_failure(self, callback: FailureCallback) -> None:
        self._callbacks.append(callback)

    def set_background(self, background: bool) -> None:
        self.process.set_nice(BACKGROUND_NICE if background else 0)

    def start_watching(self) -> None:
        """Watch the QEMU process from now on: its unexpected exit fails the sandbox."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.id}")

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[SandboxState]:
        """Hold the sandbox against a concurrent stop (e.g. while snapshotting); yields its state."""
        async with self._lock:
            yield self._state

    async def stop(self) -> str | None:
        """Stop QEMU (QMP quit, then SIGTERM, then SIGKILL) and delete the VM directory. Returns how it
        ended, or None when it was already destroyed. Idempotent."""
        async with self._lock:
            if self._state is SandboxState.DESTROYED:
                return None
            self._stopping = True
            with contextlib.suppress(Exception):
                await self._client.close()
            how = await self.process.stop()
            if self._watcher is not None:
                self._watcher.cancel()
                with contextlib.suppress(BaseException):
                    await self._watcher
            self._exited.set()
            await asyncio.to_thread(self._vmdir.remove)
            self._state = SandboxState.DESTROYED
            return how

    async def _usable_client(self) -> GuestClient:
        self._check_alive()
        if self._client.closed and self.process.returncode is None:
            async with self._reconnect_lock:
                if self._client.closed:
                    _log.warning("guest channel of %s was lost while the VM runs; reconnecting", self.id)
                    try:
                        client = await connect_agent(self._vmdir.agent_socket, pid=self.process.pid,
                                                     uid=self.vm_uid)
                    except OSError as exc:
                        # QEMU may have just died (its socket is gone) before its exit was noticed.
                        raise await self._channel_error(exc) from exc
                    try:
                        await client.wait_ready(timeout=15, interval=1.0)
                    except BaseException:
                        await client.close()
                        raise
                    self._client = client
        return self._client

    def _check_alive(self) -> None:
        if self._state is SandboxState.FAILED:
            raise SandboxFailed(f"sandbox {self.id} failed: {self._failure}", sandbox_id=self.id)
        if self._state is SandboxState.DESTROYED:
            raise SandboxFailed(f"sandbox {self.id} was destroyed", sandbox_id=self.id)

    async def _channel_error(self, exc: Exception) -> Exception:
        """Turn a lost guest channel into SandboxFailed when the VM is gone (waiting briefly, since the
        socket may close a moment before the process exit is noticed)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._exited.wait(), 2.0)
        if self._state in (SandboxState.FAILED, SandboxState.DESTROYED):
            reason = self._failure or "destroyed"
            return SandboxFailed(f"sandbox {self.id} failed: {reason}", sandbox_id=self.id)
        return exc

    async def _watch(self) -> None:
        await self.process.wait()
        self._exited.set()
        if self._stopping:
            return
        await self._fail(self.process.exit_description())

    async def _fail(self, reason: str) -> None:
        if self._state in (SandboxState.FAILED, SandboxState.DESTROYED):
            return
        self._state = SandboxState.FAILED
        self._failure = reason
        _log.warning("sandbox %s failed: %s", self.id, reason)
        with contextlib.suppress(Exception):
            await self._client.close()
        for callback in self._callbacks:
            try:
                result = callback(reason)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                _log.exception("on_failure callback of sandbox %s raised", self.id)

    def __repr__(self) -> str:
        return f"<QemuSandbox {self.id} {self._state.value} accel={self.accelerator.value} pid={self.pid}>"

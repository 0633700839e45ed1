"""A :class:`capsa.node.runtime.base.Runtime` whose sandboxes are real guest daemons run as host processes.

No VM and no kernel of its own, so it boots in a fraction of a second: it lets the control plane and node
agent tests exercise the whole request path (HTTP -> node agent -> guest channel -> real daemon) quickly.
The same API tests also run against :class:`capsa.node.runtime.qemu.QemuRuntime` in tests/integration.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.node.guest_client import GuestClient
from capsa.node.runtime.base import Accelerator, BootError, Sandbox, SandboxState, VMSpec
from tests.support.local_guest import LocalGuest

__all__ = ["FakeRuntime", "FakeSandbox", "fake_image"]


def fake_image(root: Path) -> GuestImage:
    """A GuestImage whose files exist but are never booted (the fake runtime runs the daemon directly)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("vmlinux", "initrd.cpio.gz", "rootfs.ext4"):
        (root / name).write_bytes(b"")
    return GuestImage(
        kernel=root / "vmlinux",
        initrd=root / "initrd.cpio.gz",
        rootfs=root / "rootfs.ext4",
        digest="fake",
        kernel_release="host",
    )


class FakeSandbox:
    def __init__(self, sandbox_id: str, guest: LocalGuest, client: GuestClient) -> None:
        self._id = sandbox_id
        self._local = guest
        self._client = client
        self._state = SandboxState.RUNNING
        self._failure: str | None = None
        self._callbacks: list[Callable[[str], Awaitable[None] | None]] = []
        self._watcher = asyncio.create_task(self._watch())

    @property
    def id(self) -> str:
        return self._id

    @property
    def state(self) -> SandboxState:
        return self._state

    @property
    def accelerator(self) -> Accelerator:
        return Accelerator.TCG

    @property
    def guest(self) -> GuestClient:
        return self._client

    @property
    def workdir(self) -> Path:
        return self._local.workdir

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def pid(self) -> int | None:
        return self._local.pid

    def on_failure(self, callback: Callable[[str], Awaitable[None] | None]) -> None:
        self._callbacks.append(callback)

    async def _watch(self) -> None:
        process = self._local.process
        assert process is not None
        code = await process.wait()
        if self._state is SandboxState.RUNNING:
            self._state = SandboxState.FAILED
            self._failure = f"guest daemon exited with {code}"
            await self._client.close()
            for callback in self._callbacks:
                result = callback(self._failure)
                if inspect.isawaitable(result):
                    await result

    async def destroy(self) -> None:
        if self._state is SandboxState.DESTROYED:
            return
        self._state = SandboxState.DESTROYED
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        await self._local.stop()


class FakeRuntime:
    """Sandboxes are dirs under ``base_dir`` with a guest daemon each; ``boot_error`` makes boots fail."""

    name = "fake"

    def __init__(self, base_dir: Path | None = None) -> None:
        self._own = base_dir is None
        self.base_dir = Path(tempfile.mkdtemp(prefix="capsa-fake-rt-")) if base_dir is None else base_dir
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._sandboxes: dict[str, FakeSandbox] = {}
        self.boot_error: str | None = None
        self.boots = 0

    async def boot(self, spec: VMSpec, sandbox_id: str | None = None) -> Sandbox:
        self.boots += 1
        if self.boot_error is not None:
            raise BootError(self.boot_error)
        sid = sandbox_id or new_id("sbx")
        workdir = self.base_dir / sid
        workdir.mkdir()
        local = LocalGuest(workdir)
        try:
            await local.start()
            client = await local.client()
            await client.health()
        except BaseException:
            await local.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        sandbox = FakeSandbox(sid, local, client)
        self._sandboxes[sid] = sandbox
        return sandbox

    async def destroy(self, sandbox: Sandbox) -> None:
        fake = self._sandboxes.pop(sandbox.id, None)
        if fake is not None:
            await fake.destroy()
            shutil.rmtree(fake.workdir, ignore_errors=True)

    def list(self) -> list[Sandbox]:
        return list(self._sandboxes.values())

    async def cleanup_orphans(self) -> builtins.list[str]:
        removed: builtins.list[str] = []
        for entry in self.base_dir.iterdir():
            if entry.name not in self._sandboxes:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    async def close(self) -> None:
        for sandbox in list(self._sandboxes.values()):
            await self.destroy(sandbox)
        if self._own:
            shutil.rmtree(self.base_dir, ignore_errors=True)

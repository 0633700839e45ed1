"""A :class:`capsa.node.runtime.base.Runtime` whose sandboxes are real guest daemons run as host processes.

No VM and no kernel of its own, so it boots in a fraction of a second: it lets the control plane and node
agent tests exercise the whole request path (HTTP -> node agent -> guest channel -> real daemon) quickly.
The same API tests also run against :class:`capsa.node.runtime.qemu.QemuRuntime` in tests/integration.

It can snapshot too (:class:`~capsa.node.runtime.base.SnapshotCapable`), so the production agent's
snapshot, pause, restore, branch, template and warm-pool paths run in the fast suite. A fake guest has no
RAM to save: its state is the files under its writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``,
``/run/lock``, private to it). A snapshot archives them (read through ``/proc/<daemon>/root``) as the
snapshot's ``disk.img`` next to a real :class:`~capsa.node.runtime.snapshot.manifest.SnapshotManifest`;
a restore starts a new guest daemon and unpacks the archive into its directories. Running processes are
not carried over. Snapshots need the confinement (root): without it those directories are the host's.

Tests (and schemathesis) send arbitrary commands and file operations, which here run on the HOST. So each
daemon is confined (when running as root): its own mount and PID namespaces, private tmpfs over every
world-writable directory, and it runs as ``nobody`` without capabilities. It can read the host but not
change it, and everything it started dies with it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id, new_id
from capsa.common.image import GuestImage
from capsa.node.guestlink.client import GuestClient
from capsa.node.runtime.base import Accelerator, BootError, RamMode, Sandbox, SandboxState, VMSpec
from capsa.node.runtime.snapshot.manifest import (
    DISK_FILE,
    STATE_FILE,
    FileEntry,
    Snapshot,
    SnapshotError,
    SnapshotManifest,
    file_sha256,
    write_manifest,
)
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


_MACHINE = "fake-guest-process"
_GUEST_DIRS = ("tmp", "var/tmp", "dev/shm", "run/lock")
"""The fake guest's own writable directories (tmpfs in its mount namespace): what a snapshot holds."""


class FakeSandbox:
    def __init__(self, sandbox_id: str, guest: LocalGuest, client: GuestClient, confined: bool,
                 spec: VMSpec) -> None:
        self.spec = spec
        self.parent: str | None = None
        self._id = sandbox_id
        self._confined = confined
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
        """The daemon's pid (when confined: the namespace's init, whose death ends every process in it)."""
        launcher = self._local.pid
        if launcher is None or not self._confined:
            return launcher
        try:
            children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def on_failure(self, callback: Callable[[str], Awaitable[None] | None]) -> None:
        self._callbacks.append(callback)

    def set_background(self, background: bool) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, pid, 19 if background else 0)

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
        pid = self.pid
        if self._confined and pid is not None:
            # The namespace init ignores SIGTERM; SIGKILL on it ends the whole namespace at once.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await self._local.stop()


# pdeathsig twice: if the test process dies, unshare dies, then the daemon (the namespace's init) dies, and
# with it every process of the namespace. setpriv sets it after changing credentials (a uid change clears it).
_CONFINE = """#!/bin/sh
exec /usr/bin/setpriv --pdeathsig KILL -- \\
    /usr/bin/unshare --mount --pid --fork --kill-child --mount-proc --propagation private -- /bin/sh -c '
for d in /tmp /var/tmp /dev/shm /run/lock; do
    mount -t tmpfs -o mode=1777,size=256m capsa-fake "$d" || exit 97
done
HOME=/tmp exec /usr/bin/setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all \\
    --bounding-set=-all --pdeathsig KILL -- /usr/bin/python3 "$@"' capsa-fake-guest "$@"
"""
_WRITABLE = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/run/lock"))


def _nic(spec: VMSpec) -> str:
    mac = getattr(spec.network, "mac", None) if spec.network is not None else None
    return f"+nic:{mac}" if mac else ""


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SnapshotError(f"{argv[0]} failed: {err.decode(errors='replace')[-300:]}")


def _confinable() -> bool:
    return os.geteuid() == 0 and all(Path(p).exists() for p in ("/usr/bin/unshare", "/usr/bin/setpriv"))


class FakeRuntime:
    """Sandboxes are dirs under ``base_dir`` with a guest daemon each; ``boot_error`` makes boots fail."""

    name = "fake"

    def __init__(self, base_dir: Path | None = None, *, confine: bool | None = None) -> None:
        self.confine = _confinable() if confine is None else confine
        if (
            self.confine
            and base_dir is not None
            and any(base_dir.resolve().is_relative_to(p) for p in _WRITABLE)
        ):
            base_dir = None  # it would be hidden from a confined daemon (e.g. a pytest tmp_path): use /run
        self._own = base_dir is None
        if base_dir is None:
            # Outside every directory the confinement hides, and traversable by ``nobody``.
            base_dir = Path(tempfile.mkdtemp(prefix="capsa-fake-rt-", dir="/run" if self.confine else None))
            base_dir.chmod(0o755)
        self.base_dir = base_dir
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._python: str | None = None
        if self.confine:
            wrapper = self.base_dir / ".confine.sh"
            wrapper.write_text(_CONFINE)
            wrapper.chmod(0o755)
            self._python = str(wrapper)
        self._sandboxes: dict[str, FakeSandbox] = {}
        self.boot_error: str | None = None
        self.boots = 0
        self.restores = 0
        self.ram_modes: list[tuple[RamMode, str | None]] = []
        """(mode, domain) of every restore, in order."""
        self.hostnames: dict[str, str] = {}
        """sandbox id -> the hostname :meth:`bind_identity` gave it."""
        self.snapshots_dir = self.base_dir / ".snapshots"
        self._templates_dir = self.base_dir / ".templates"
        self.snapshots_dir.mkdir(exist_ok=True)
        self._templates_dir.mkdir(exist_ok=True)

    async def bind_identity(self, sandbox: Sandbox, hostname: str) -> None:
        """The identity binder for this runtime's sandboxes (an ``IdentityBinder``): a guest on the host
        may not set the clock or the hostname, so the name is recorded here and the guest only checked."""
        await sandbox.guest.health()
        self.hostnames[sandbox.id] = hostname

    async def boot(self, spec: VMSpec, sandbox_id: str | None = None) -> Sandbox:
        self.boots += 1
        if self.boot_error is not None:
            raise BootError(self.boot_error)
        return await self._start(spec, sandbox_id)

    async def _start(self, spec: VMSpec, sandbox_id: str | None) -> FakeSandbox:
        sid = sandbox_id or new_id("sbx")
        if sid in self._sandboxes:
            raise BootError(f"sandbox {sid} already exists")
        workdir = self.base_dir / sid
        workdir.mkdir()
        if self.confine:
            os.chown(workdir, 65534, 65534)  # the daemon (nobody) creates its socket here
            workdir.chmod(0o755)
        local = LocalGuest(workdir, python=self._python)
        try:
            await local.start()
            client = await local.client()
            await client.health()
        except BaseException:
            await local.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        sandbox = FakeSandbox(sid, local, client, self.confine, spec)
        self._sandboxes[sid] = sandbox
        return sandbox

    # -- snapshots (SnapshotCapable) -------------------------------------------------------------------

    @property
    def can_snapshot(self) -> bool:
        return self.confine  # snapshots read a confined guest's private dirs

    @property
    def templates_dir(self) -> Path:
        return self._templates_dir

    def _guest_root(self, sandbox: FakeSandbox) -> Path:
        pid = sandbox.pid
        if not self.confine or pid is None:
            raise CapsaError("the fake runtime snapshots only confined guests (run as root)",
                             code="snapshot_unsupported", status=409)
        return Path(f"/proc/{pid}/root")

    async def snapshot(self, sandbox: Sandbox, dest: Path | str | None = None, *, resume: bool = True,
                       labels: dict[str, str] | None = None, content_digest: bool = False) -> Snapshot:
        fake = self._sandboxes.get(sandbox.id)
        if fake is None or fake is not sandbox or fake.state is not SandboxState.RUNNING:
            raise SnapshotError(f"sandbox {sandbox.id} is not running here", code="invalid_state", status=409)
        root = self._guest_root(fake)
        if dest is None or isinstance(dest, str):
            dest = self.snapshots_dir / (dest or new_id("snap"))
        dest.mkdir(mode=0o711)
        try:
            disk = dest / DISK_FILE
            await _run("tar", "-C", str(root), "--numeric-owner", "-cpf", str(disk), *_GUEST_DIRS)
            state = dest / STATE_FILE
            state.write_text(json.dumps({"fake": True, "dirs": list(_GUEST_DIRS)}))
            manifest = SnapshotManifest(
                id=dest.name, created_at=SnapshotManifest.now(), memory_mib=fake.spec.memory_mib,
                vcpus=fake.spec.vcpus, accel=Accelerator.TCG.value, image_digest=fake.spec.image.digest,
                machine=_MACHINE + _nic(fake.spec),
                device_state=FileEntry(path=STATE_FILE, size=state.stat().st_size, sha256=file_sha256(state)),
                ram=None, disk=FileEntry(path=DISK_FILE, size=disk.stat().st_size,
                                         sha256=file_sha256(disk) if content_digest else None),
                parent=fake.parent, labels=dict(labels or {}))
            sealed = write_manifest(dest, manifest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        fake.parent = sealed.id
        return Snapshot(dest, sealed)

    def _open(self, snapshot: Snapshot | Path | str) -> Snapshot:
        if isinstance(snapshot, Snapshot):
            return snapshot
        return Snapshot.open(self.snapshots_dir / snapshot if isinstance(snapshot, str) else snapshot)

    def can_restore(self, snapshot: Snapshot, spec: VMSpec) -> bool:
        m = snapshot.manifest
        return m.machine == _MACHINE + _nic(spec) and (m.memory_mib, m.vcpus) == (spec.memory_mib, spec.vcpus)

    async def restore(self, snapshot: Snapshot | Path | str, spec: VMSpec, *, sandbox_id: str | None = None,
                      ram_mode: RamMode = RamMode.COPY, refresh: bool = True,
                      ram_domain: str | None = None) -> Sandbox:
        snap = self._open(snapshot)
        self.ram_modes.append((ram_mode, ram_domain))
        if not self.can_restore(snap, spec) or snap.manifest.image_digest != spec.image.digest:
            raise SnapshotError(f"snapshot {snap.id} does not fit this sandbox", code="snapshot_mismatch",
                                status=409)
        self.restores += 1
        fake = await self._start(spec, sandbox_id)
        try:
            await _run("tar", "-C", str(self._guest_root(fake)), "--numeric-owner", "-xpf",
                       str(snap.path / DISK_FILE))
        except BaseException:
            await self.destroy(fake)
            raise
        fake.parent = snap.id
        return fake

    async def branch(self, snapshot: Snapshot | Path | str, n: int, spec: VMSpec, *,
                     ram_mode: RamMode = RamMode.PRIVATE) -> builtins.list[Sandbox]:
        snap = self._open(snapshot)
        made: builtins.list[Sandbox] = []
        try:
            for _ in range(n):
                made.append(await self.restore(snap, spec, ram_mode=ram_mode))
        except BaseException:
            for sandbox in made:
                await self.destroy(sandbox)
            raise
        return made

    def open_snapshot(self, snapshot_id: str) -> Snapshot:
        if not is_id(snapshot_id, "snap") or not (self.snapshots_dir / snapshot_id).is_dir():
            raise CapsaError(f"snapshot {snapshot_id!r} not found", code="snapshot_not_found", status=404)
        return Snapshot.open(self.snapshots_dir / snapshot_id)

    def list_snapshot_ids(self) -> builtins.list[str]:
        return sorted(p.name for p in self.snapshots_dir.iterdir() if is_id(p.name, "snap"))

    def delete_snapshot(self, snapshot: Snapshot | str) -> bool:
        path = snapshot.path if isinstance(snapshot, Snapshot) else self.snapshots_dir / snapshot
        doomed = path.with_name(f".{path.name}.del-{os.urandom(4).hex()}")
        try:  # renamed aside first, as the pool does: of two deletes at once, one wins and neither fails
            path.rename(doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed)
        return True

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
            if entry.name not in self._sandboxes and not entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    async def close(self) -> None:
        for sandbox in list(self._sandboxes.values()):
            await self.destroy(sandbox)
        if self._own:
            shutil.rmtree(self.base_dir, ignore_errors=True)

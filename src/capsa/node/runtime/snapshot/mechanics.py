"""VM snapshots with QEMU migration: save, restore, and the files a restored VM runs from.

How it works (RECIPES.md, "Snapshots"):

* A VM that can be snapshotted cheaply keeps its RAM in a file mapped shared
  (``memory-backend-file,share=on`` + ``-machine memory-backend=``). With the ``x-ignore-shared``
  migration capability QEMU then leaves that RAM out of the migration stream, so saving is: stop the VM,
  migrate the device state (~60 KB) into ``state.bin``, reflink the RAM file and the disk while the VM is
  stopped (both are exactly the guest's state at that instant), then quit or continue.
* A VM whose RAM is private (anonymous, or a private mapping of someone else's file) is saved the same way,
  except QEMU writes the RAM pages into ``state.bin`` too; the manifest records ``ram: null``.
* Restoring starts QEMU with the snapshot's command line plus ``-incoming defer``, feeds ``state.bin``
  through ``migrate-incoming``, and continues. The RAM is either a private mapping of the snapshot's frozen
  ``memory.ram`` (no copy at all; clones share page cache) or a reflinked copy mapped shared, which keeps
  the restored VM cheap to snapshot again.

The migration stream always travels over a file descriptor handed to QEMU on the monitor socket
(``getfd`` + ``fd:``), never ``exec:``: QEMU runs under ``-sandbox spawn=deny`` and as an unprivileged
user, and the node, not QEMU, decides which file it reads or writes.

After every restore the guest kernel still holds the RNG state and clock of the moment of the snapshot,
so :func:`capsa.node.guestlink.identity.refresh_guest` pushes fresh entropy with a forced reseed and sets
the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from capsa.node.runtime.base import RamMode
from capsa.node.runtime.snapshot.manifest import (
    DISK_FILE,
    RAM_FILE,
    STATE_FILE,
    FileEntry,
    SnapshotError,
    SnapshotManifest,
    file_sha256,
    load_manifest,
    write_manifest,
)
from capsa.node.runtime.snapshot.ram_delta import DeltaStats, StreamFormatError, filter_stream

__all__ = [
    "LABEL_RAM_DELTA",
    "MAX_BRANCHES",
    "MEMORY_BACKEND_ID",
    "CloneFn",
    "Monitor",
    "RamBase",
    "RamMode",
    "RestorePlan",
    "SnapshotError",
    "check_branch_count",
    "create_ram_file",
    "incoming_args",
    "load_state",
    "memory_backend_args",
    "plan_restore",
    "save_delta_state",
    "save_snapshot",
]

_log = logging.getLogger(__name__)

MEMORY_BACKEND_ID = "mem0"
MAX_BRANCHES = 64
# Bytes per second. The default (32 MiB/s) is meant for live migration over a network; a stopped VM
# writing to a local file should go as fast as the disk allows.
_MAX_BANDWIDTH = 1 << 40
LABEL_RAM_DELTA = "capsa.ram-delta"
"""Snapshot label: the stream holds the RAM pages that differ from ``memory.ram`` (the frozen RAM the VM
was restored from, reflinked in), so a restore maps that file and loads the pages over it. The value is
the id of the snapshot the RAM came from."""
_POLL = 0.005


class Monitor(Protocol):
    """The part of ``qemu.qmp.QMPClient`` snapshots need."""

    async def execute(self, cmd: str, arguments: Mapping[str, object] | None = None) -> object: ...

    def send_fd_scm(self, fd: int) -> None: ...


CloneFn = Callable[[Path, Path], bool]
"""Copy ``src`` to a new file ``dst`` (reflink when possible); True when extents are shared. The node
clones as root from files a VM user may own, so it must refuse a source that is a symlink or not the
file it expects (``StoragePool.clone`` with ``source_owner``)."""


def _qemu_escape(value: str) -> str:
    # QEMU option values use ',' as separator and ',,' as an escaped comma.
    return value.replace(",", ",,")


def memory_backend_args(memory_mib: int, ram: Path | None, *, share: bool) -> list[str]:
    """Arguments that give the VM its RAM from ``ram`` (or anonymous memory when None).

    The backend is always named :data:`MEMORY_BACKEND_ID` because the migration stream identifies RAM
    blocks by that name: the restoring QEMU must use the same one.
    """
    if ram is None:
        obj = f"memory-backend-ram,id={MEMORY_BACKEND_ID},size={memory_mib}M"
    else:
        obj = (f"memory-backend-file,id={MEMORY_BACKEND_ID},size={memory_mib}M,"
               f"mem-path={_qemu_escape(str(ram))},share={'on' if share else 'off'}")
    return ["-object", obj, "-machine", f"memory-backend={MEMORY_BACKEND_ID}"]


def incoming_args() -> list[str]:
    return ["-incoming", "defer"]


def create_ram_file(path: Path, memory_mib: int, *, owner: tuple[int, int] | None = None) -> None:
    """A sparse file for a VM's shared RAM; QEMU (possibly another uid) maps it read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, memory_mib * 1024 * 1024)
        if owner is not None:
            os.fchown(fd, owner[0], owner[1])
    finally:
        os.close(fd)


def check_branch_count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BRANCHES:
        raise SnapshotError(f"branch count must be between 1 and {MAX_BRANCHES}, got {n!r}",
                            code="invalid_branch_count", status=422)
    return n


# -- the migration stream ----------------------------------------------------------------------------


async def _configure(monitor: Monitor, ignore_shared: bool) -> None:
    # Both ends must agree: the capability changes the stream's format, not only what is sent. It is off
    # when the RAM travels in the stream, because a restoring QEMU with the capability on would refuse
    # pages for a RAM block it maps shared.
    await monitor.execute("migrate-set-capabilities",
                          {"capabilities": [{"capability": "x-ignore-shared", "state": ignore_shared}]})
    await monitor.execute("migrate-set-parameters", {"max-bandwidth": _MAX_BANDWIDTH})


async def _pass_fd(monitor: Monitor, fd: int) -> str:
    name = "snap" + secrets.token_hex(4)
    monitor.send_fd_scm(fd)
    await monitor.execute("getfd", {"fdname": name})
    return name


async def _wait_migration(monitor: Monitor, time_limit: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + time_limit
    while True:
        info = await monitor.execute("query-migrate")
        status = info.get("status") if isinstance(info, dict) else None
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            detail = info.get("error-desc", status) if isinstance(info, dict) else status
            raise SnapshotError(f"{what} failed: {detail}")
        if loop.time() > deadline:
            with contextlib.suppress(Exception):
                await monitor.execute("migrate_cancel")
            raise SnapshotError(f"{what} did not finish within {time_limit:.0f}s (last status {status})")
        await asyncio.sleep(_POLL)


async def _run_state(monitor: Monitor) -> str:
    info = await monitor.execute("query-status")
    return str(info.get("status")) if isinstance(info, dict) else "unknown"


async def save_state(monitor: Monitor, state_path: Path, *, ram_in_file: bool,
                     time_limit: float = 120.0) -> None:
    """Write the stopped VM's migration stream to ``state_path`` (created, must not exist).

    ``ram_in_file``: the VM's RAM is a shared file saved separately, so leave it out of the stream.
    """
    await _configure(monitor, ram_in_file)
    fd = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        name = await _pass_fd(monitor, fd)
        await monitor.execute("migrate", {"uri": f"fd:{name}"})
        await _wait_migration(monitor, time_limit, "saving the VM state")
        os.fsync(fd)
    finally:
        os.close(fd)


def _filter_into(read_fd: int, state_path: Path, base: Path) -> DeltaStats | None:
    """Filter the stream QEMU writes into the pipe ``read_fd`` against ``base`` into ``state_path``; None
    when the stream could not be read (the rest is drained so QEMU can finish, and the file removed)."""
    with os.fdopen(read_fd, "rb", buffering=1 << 20) as src:
        try:
            with open(base, "rb") as base_file, \
                    mmap.mmap(base_file.fileno(), 0, prot=mmap.PROT_READ) as pages, \
                    open(state_path, "xb", buffering=1 << 20) as out:
                stats = filter_stream(src, out, MEMORY_BACKEND_ID, pages)
                out.flush()
                os.fsync(out.fileno())
                return stats
        except Exception as exc:
            while src.read(1 << 20):  # QEMU must not block on a full pipe
                pass
            state_path.unlink(missing_ok=True)
            if not isinstance(exc, StreamFormatError):
                raise
            _log.warning("keeping the whole RAM in the snapshot: %s", exc)
            return None


async def save_delta_state(monitor: Monitor, state_path: Path, base: Path, *,
                           time_limit: float = 120.0) -> DeltaStats | None:
    """Write the stopped VM's migration stream to ``state_path`` with only the RAM pages that differ from
    ``base``, the frozen RAM its private mapping was restored from (:mod:`ram_delta`). If the stream cannot
    be filtered, the whole stream is written instead and None returned."""
    await _configure(monitor, False)
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        name = await _pass_fd(monitor, write_fd)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # QEMU holds its own copy: the pipe ends when its migration does
    filtering = asyncio.ensure_future(asyncio.to_thread(_filter_into, read_fd, state_path, base))
    try:
        await monitor.execute("migrate", {"uri": f"fd:{name}"})
        await _wait_migration(monitor, time_limit, "saving the VM state")
    except BaseException:
        # The pipe ends (and the filter with it) once QEMU lets go of its end: a migration that started
        # closes it when cancelled, a descriptor it never used is closed by name.
        for cmd, args in (("migrate_cancel", None), ("closefd", {"fdname": name})):
            with contextlib.suppress(Exception):
                await monitor.execute(cmd, args)
        await asyncio.shield(filtering)
        raise
    stats = await filtering
    if stats is None:
        await save_state(monitor, state_path, ram_in_file=False, time_limit=time_limit)
    return stats


async def load_state(monitor: Monitor, state_path: Path, *, ram_in_file: bool, time_limit: float = 120.0,
                     start: bool = True) -> None:
    """Feed ``state_path`` to a QEMU started with :func:`incoming_args`, then (by default) run the VM.

    ``ram_in_file`` must be what the snapshot was saved with (``manifest.ram is not None``).
    """
    await _configure(monitor, ram_in_file)
    fd = os.open(state_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        name = await _pass_fd(monitor, fd)
        await monitor.execute("migrate-incoming", {"uri": f"fd:{name}"})
        await _wait_migration(monitor, time_limit, f"loading {state_path}")
    finally:
        os.close(fd)
    if start:
        await monitor.execute("cont")


# -- saving ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RamBase:
    """The frozen RAM a VM's private mapping was restored from."""

    pages: Path
    """What the VM maps: readable by this process (the sealed memfd, ``/proc/self/fd/N``)."""
    file: Path
    """The snapshot's RAM file the pages were copied from."""
    snapshot_id: str
    clone: CloneFn
    """Reflinks :attr:`file` (a root-owned file) into a snapshot."""

    def freeze(self, dest: Path) -> bool:
        """``dest``: a reflink of :attr:`file` (synced with the snapshot's other files); False when the
        file is gone (its snapshot was deleted)."""
        try:
            self.clone(self.file, dest)
        except FileNotFoundError:
            return False
        return True


def _entry(path: Path, content_digest: bool) -> FileEntry:
    return FileEntry(path=path.name, size=path.stat().st_size,
                     sha256=file_sha256(path) if content_digest else None)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_snapshot(
    monitor: Monitor,
    dest: Path,
    *,
    disk: Path,
    ram: Path | None,
    clone: CloneFn,
    memory_mib: int,
    vcpus: int,
    accel: str,
    image_digest: str,
    qemu_version: str | None = None,
    machine: str | None = None,
    parent: str | None = None,
    labels: Mapping[str, str] | None = None,
    resume: bool = True,
    content_digest: bool = False,
    time_limit: float = 120.0,
    ram_base: RamBase | None = None,
) -> SnapshotManifest:
    """Snapshot a VM into the new directory ``dest``.

    ``ram`` is the VM's shared RAM file, or None when its RAM is private (then the pages go into the
    state file). ``ram_base``: the VM's private RAM maps a frozen RAM file, so the state file gets only the
    pages that differ from it and the snapshot a reflink of it (labelled :data:`LABEL_RAM_DELTA`). With
    ``resume`` a VM that was running runs again afterwards (rolling snapshots); without,
    it is left stopped for the caller to destroy (pause). On failure nothing is left at ``dest`` and a VM
    that was running is continued.
    """
    work = _make_work_dir(dest)
    was_running = False
    ok = False
    try:
        base = None  # the delta's base, reflinked in first (the frozen file does not change)
        if ram is None and ram_base is not None and await asyncio.to_thread(ram_base.freeze, work / RAM_FILE):
            base = ram_base
        was_running = await _run_state(monitor) == "running"
        if was_running:
            # stop drains and flushes QEMU's block layer, so the disk file is consistent from here on.
            await monitor.execute("stop")
        delta = None
        if base is not None:
            delta = await save_delta_state(monitor, work / STATE_FILE, base.pages, time_limit=time_limit)
            if delta is None:  # the whole RAM went into the stream after all
                (work / RAM_FILE).unlink()
        else:
            await save_state(monitor, work / STATE_FILE, ram_in_file=ram is not None, time_limit=time_limit)
        # The VM is stopped: the disk and (shared) RAM files are frozen at the same instant as the state.
        await asyncio.to_thread(_freeze_files, clone, disk, ram, work)
        if delta is not None and base is not None:
            labels = {**(labels or {}), LABEL_RAM_DELTA: base.snapshot_id}
            _log.debug("snapshot %s: %d RAM pages differ from %s, %d do not", dest.name, delta.pages_kept,
                       base.snapshot_id, delta.pages_dropped)
        manifest = SnapshotManifest(
            id=dest.name,
            created_at=SnapshotManifest.now(),
            memory_mib=memory_mib,
            vcpus=vcpus,
            accel=accel,
            image_digest=image_digest,
            qemu_version=qemu_version,
            machine=machine,
            device_state=_entry(work / STATE_FILE, True),
            ram=(await asyncio.to_thread(_entry, work / RAM_FILE, content_digest)
                 if ram is not None or delta is not None else None),
            disk=await asyncio.to_thread(_entry, work / DISK_FILE, content_digest),
            parent=parent,
            labels=dict(labels or {}),
        )
        sealed = write_manifest(work, manifest)
        os.rename(work, dest)
        _fsync_path(dest.parent)
        ok = True
        return sealed
    finally:
        if not ok:
            shutil.rmtree(work, ignore_errors=True)
        if was_running and ok and resume:
            await monitor.execute("cont")
        elif was_running and not ok:
            # Continuing may fail too (QEMU reopens its disk by name after a migration, and a VM whose
            # disk was swapped under it cannot go on); the error that stopped the snapshot is the one
            # to report.
            with contextlib.suppress(Exception):
                await monitor.execute("cont")


def _make_work_dir(dest: Path) -> Path:
    if dest.exists():
        raise SnapshotError(f"snapshot destination {dest} already exists", code="snapshot_exists", status=409)
    if not dest.parent.is_dir():
        raise SnapshotError(f"snapshot parent directory {dest.parent} does not exist")
    # Built under a hidden name and renamed at the end, so a crash never leaves a half snapshot that
    # looks complete.
    work = dest.with_name(f".{dest.name}.partial-{secrets.token_hex(4)}")
    work.mkdir(mode=0o700)
    return work


def _freeze_files(clone: CloneFn, disk: Path, ram: Path | None, work: Path) -> None:
    clone(disk, work / DISK_FILE)
    if ram is not None:
        clone(ram, work / RAM_FILE)
    for name in (DISK_FILE, RAM_FILE):
        if (work / name).exists():
            _fsync_path(work / name)


# -- restoring ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestorePlan:
    """What a new QEMU needs to come up from a snapshot: its disk, extra arguments and the state file."""

    manifest: SnapshotManifest
    disk: Path
    ram: Path | None
    shared_ram: bool
    state: Path
    extra_args: Sequence[str]

    @property
    def ram_in_file(self) -> bool:
        """The whole RAM is in the RAM file (else some or all of it is in the stream)."""
        return self.manifest.ram is not None and LABEL_RAM_DELTA not in self.manifest.labels

    async def load(self, monitor: Monitor, *, time_limit: float = 120.0, start: bool = True) -> None:
        """Feed the snapshot's state to the QEMU started with ``extra_args``."""
        await load_state(monitor, self.state, ram_in_file=self.ram_in_file, time_limit=time_limit,
                         start=start)


def plan_restore(
    snapshot_dir: Path,
    sandbox_dir: Path,
    *,
    clone: CloneFn,
    mode: RamMode = RamMode.COPY,
    owner: tuple[int, int] | None = None,
    memory_mib: int | None = None,
    vcpus: int | None = None,
    image_digest: str | None = None,
) -> RestorePlan:
    """Check the snapshot against what the caller wants and lay out the sandbox's files.

    Creates ``sandbox_dir/disk.img`` (and ``memory.ram`` in COPY and CLONE modes), owned by ``owner``. The
    caller starts QEMU with ``extra_args`` and then calls :func:`load_state` with ``state``.
    """
    manifest = load_manifest(snapshot_dir)
    for what, want, have in (("memory_mib", memory_mib, manifest.memory_mib),
                             ("vcpus", vcpus, manifest.vcpus),
                             ("image digest", image_digest, manifest.image_digest)):
        if want is not None and want != have:
            raise SnapshotError(f"snapshot {manifest.id} was taken with {what} {have}, not {want}",
                                code="snapshot_mismatch", status=409)
    if not sandbox_dir.is_dir():
        raise SnapshotError(f"sandbox directory {sandbox_dir} does not exist")
    disk = sandbox_dir / DISK_FILE
    created: list[Path] = []
    try:
        clone(snapshot_dir / manifest.disk.path, disk)
        created.append(disk)
        if owner is not None:
            os.chown(disk, *owner, follow_symlinks=False)
        ram: Path | None
        if mode in (RamMode.COPY, RamMode.CLONE):
            ram = sandbox_dir / RAM_FILE
            if manifest.ram is not None:
                clone(snapshot_dir / manifest.ram.path, ram)
                created.append(ram)
                if owner is not None:
                    os.chown(ram, *owner, follow_symlinks=False)
            else:
                create_ram_file(ram, manifest.memory_mib, owner=owner)
                created.append(ram)
            shared = mode is RamMode.COPY
        else:
            ram = snapshot_dir / manifest.ram.path if manifest.ram is not None else None
            shared = False
    except BaseException:
        for p in created:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        raise
    args = [*memory_backend_args(manifest.memory_mib, ram, share=shared), *incoming_args()]
    return RestorePlan(manifest=manifest, disk=disk, ram=ram, shared_ram=shared,
                       state=snapshot_dir / manifest.device_state.path, extra_args=args)



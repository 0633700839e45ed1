"""Where a VM's disk and RAM live: the storage strategy plugged into :class:`QemuRuntime`.

* :class:`WorkdirStorage`: the disk is a private copy of the image (a reflink where the filesystem can)
  inside the VM's work directory and the RAM is anonymous memory. Nothing to snapshot from.
* :class:`PoolStorage`: everything on the node's :class:`~capsa.node.storage.pool.StoragePool`. The disk is
  a reflink of a pool copy of the image and the RAM a file mapped shared (``sandboxes/<sbx id>/``), so a
  snapshot reflinks both while the VM is stopped and its migration stream is only the device state.
  Restores clone (or privately map) a snapshot's files; snapshots and templates live in the pool too.

Privileges: a VM's disk and RAM belong to its own VM uid. VMs that map a snapshot's frozen RAM privately
(:attr:`RamMode.PRIVATE`: branches) never get the file itself, which stays root's (mode 0600): QEMU 7.2
opens a memory backend read-write even for a private mapping, so each gets a sealed memfd copy of it
(:mod:`capsa.node.runtime.qemu.sealed_ram`), one per snapshot shared by its branches, which no process can
write.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from capsa.node.runtime.base import RamMode, VMSpec
from capsa.node.runtime.qemu.sealed_ram import SealedRam
from capsa.node.runtime.snapshot.manifest import RAM_FILE, Snapshot, SnapshotError
from capsa.node.runtime.snapshot.mechanics import (
    RamBase,
    RestorePlan,
    create_ram_file,
    incoming_args,
    memory_backend_args,
    plan_restore,
)
from capsa.node.runtime.workdir import VmDir
from capsa.node.storage.disks import private_disk
from capsa.node.storage.filecopy import CopyError, copy_file
from capsa.node.storage.pool import StoragePool

__all__ = ["PoolStorage", "VmFiles", "VmStorage", "WorkdirStorage"]

_IMAGE_PREFIX = "image-"


@dataclass(frozen=True)
class VmFiles:
    """The files one VM runs from, and what QEMU needs to use them."""

    disk: Path
    disk_cow: bool
    ram: Path | None
    """The RAM file (None: anonymous memory)."""
    shared_ram: bool
    """True: the RAM file is mapped shared, so snapshots leave it out of the stream (x-ignore-shared)."""
    qemu_args: tuple[str, ...] = ()
    """Memory backend arguments (plus ``-incoming defer`` for a restore)."""
    fds: tuple[int, ...] = ()
    """Descriptors QEMU inherits for these files (a sealed copy of a snapshot's frozen RAM); the storage's,
    closed by its :meth:`VmStorage.release`."""
    restore: RestorePlan | None = None
    """The snapshot state to load once QEMU is up (None: a cold boot)."""
    private_ram: bool = False
    """The RAM is the sandbox's own clone mapped privately (:attr:`RamMode.CLONE`)."""
    ram_base: RamBase | None = None
    """The RAM is a private mapping of this frozen RAM (:attr:`RamMode.PRIVATE`): snapshots record only
    the pages that differ from it."""


class VmStorage(Protocol):
    """Lays out and removes the files of each VM. Methods block: the runtime calls them in a thread."""

    @property
    def pool(self) -> StoragePool | None:
        """The snapshot and template store; None when VMs on this storage cannot be snapshotted."""
        ...

    def boot_files(self, sandbox_id: str, spec: VMSpec, vmdir: VmDir,
                   owner: tuple[int, int] | None) -> VmFiles:
        """A fresh disk (and RAM) for a cold boot of ``spec``; ``owner`` is the VM user."""
        ...

    def restore_files(self, sandbox_id: str, snapshot: Snapshot, spec: VMSpec, mode: RamMode,
                      owner: tuple[int, int] | None, *, domain: str | None = None) -> VmFiles:
        """The disk and RAM of a VM restored from ``snapshot`` (``domain``: who shares its RAM pages in
        :attr:`RamMode.PRIVATE`; None: the snapshot's branches)."""
        ...

    def release(self, sandbox_id: str) -> None:
        """Delete what :meth:`boot_files` or :meth:`restore_files` made for the sandbox (idempotent)."""
        ...

    def prune(self, keep: set[str]) -> list[str]:
        """Delete the files of every sandbox not in ``keep`` (left by a previous node process)."""
        ...


class WorkdirStorage:
    """Disk copies in each VM's work directory (removed with it), anonymous RAM, no snapshots."""

    @property
    def pool(self) -> StoragePool | None:
        return None

    def boot_files(self, sandbox_id: str, spec: VMSpec, vmdir: VmDir,
                   owner: tuple[int, int] | None) -> VmFiles:
        disk = private_disk(spec.rootfs or spec.image.rootfs, vmdir.disk, size_mib=spec.disk_size_mib,
                            owner=owner)
        return VmFiles(disk=disk.path, disk_cow=disk.cow, ram=None, shared_ram=False)

    def restore_files(self, sandbox_id: str, snapshot: Snapshot, spec: VMSpec, mode: RamMode,
                      owner: tuple[int, int] | None, *, domain: str | None = None) -> VmFiles:
        raise SnapshotError("this runtime keeps VM disks in their work directories and cannot restore "
                            "snapshots (it needs the storage pool)", code="snapshot_unsupported", status=409)

    def release(self, sandbox_id: str) -> None:
        return None  # the disk is inside the VM directory, which the runtime removes

    def prune(self, keep: set[str]) -> list[str]:
        return []


class PoolStorage:
    """VM disks and RAM files on the node's storage pool, which also holds snapshots and templates."""

    def __init__(self, pool: StoragePool, *, image_copies: int = 2) -> None:
        self._pool = pool
        self.image_copies = image_copies
        self.sealed_ram = SealedRam()

    @property
    def pool(self) -> StoragePool:
        return self._pool

    def boot_files(self, sandbox_id: str, spec: VMSpec, vmdir: VmDir,
                   owner: tuple[int, int] | None) -> VmFiles:
        pool_dir = self._pool.sandbox_dir(sandbox_id, create=True)
        try:
            rootfs = spec.rootfs or self._pool_rootfs(spec)
            disk = private_disk(rootfs, pool_dir / "disk.img", size_mib=spec.disk_size_mib, owner=owner)
            ram = pool_dir / RAM_FILE
            create_ram_file(ram, spec.memory_mib, owner=owner)
        except BaseException:
            self._pool.remove_sandbox(sandbox_id)
            raise
        shared = not spec.private_ram
        return VmFiles(disk=disk.path, disk_cow=disk.cow, ram=ram, shared_ram=shared,
                       qemu_args=tuple(memory_backend_args(spec.memory_mib, ram, share=shared)),
                       private_ram=not shared)

    def restore_files(self, sandbox_id: str, snapshot: Snapshot, spec: VMSpec, mode: RamMode,
                      owner: tuple[int, int] | None, *, domain: str | None = None) -> VmFiles:
        pool_dir = self._pool.sandbox_dir(sandbox_id, create=True)
        try:
            # A snapshot's files are the node's own: anything else under their names was planted.
            clone = functools.partial(self._pool.clone, source_owner=os.geteuid())
            plan = plan_restore(snapshot.path, pool_dir, clone=clone, mode=mode, owner=owner,
                                memory_mib=spec.memory_mib, vcpus=spec.vcpus, image_digest=spec.image.digest)
            fds: tuple[int, ...] = ()
            base = None
            if mode is RamMode.PRIVATE and plan.ram is not None:
                # QEMU maps the sealed memfd of the frozen file that VMs of ``domain`` share, through the
                # descriptor it inherits (/proc/self/fd/N), never the file itself.
                # A branch set (no domain) copies whole: the copy is on the branch's path.
                fd = self.sealed_ram.acquire(plan.ram, sandbox_id, domain or snapshot.manifest.id,
                                             sparse=domain is not None)
                mapped = Path(f"/proc/self/fd/{fd}")
                base = RamBase(pages=mapped, file=plan.ram, snapshot_id=snapshot.manifest.id, clone=clone)
                args = (*memory_backend_args(plan.manifest.memory_mib, mapped, share=False), *incoming_args())
                plan, fds = dataclasses.replace(plan, ram=mapped, extra_args=args), (fd,)
        except BaseException:
            self.sealed_ram.release(sandbox_id)
            self._pool.remove_sandbox(sandbox_id)
            raise
        return VmFiles(disk=plan.disk, disk_cow=self._pool.cow, ram=plan.ram, shared_ram=plan.shared_ram,
                       qemu_args=tuple(plan.extra_args), fds=fds, restore=plan,
                       private_ram=mode is RamMode.CLONE, ram_base=base)

    def release(self, sandbox_id: str) -> None:
        self.sealed_ram.release(sandbox_id)
        self._pool.remove_sandbox(sandbox_id)

    def prune(self, keep: set[str]) -> list[str]:
        return self._pool.prune_sandboxes(keep)

    def _pool_rootfs(self, spec: VMSpec) -> Path:
        """The image's root filesystem inside the pool, so sandbox disks are reflinks of it, not copies."""
        tdir = self._pool.template_dir(_IMAGE_PREFIX + spec.image.digest.split(":")[-1][:32])
        path = tdir / "rootfs.ext4"
        if not path.exists():
            tdir.mkdir(mode=0o711, exist_ok=True)
            try:
                copy_file(spec.image.rootfs, path, cow=self._pool.cow, mode=0o600)
            except CopyError:
                if not path.exists():  # else a concurrent boot of the same image made it first
                    raise
            self._prune_image_copies(keep=tdir)
        return path

    def _prune_image_copies(self, keep: Path) -> None:
        """Drop pool copies of older images. Safe at any time: disks made from them are reflinks and
        keep their extents; only the next boot of a dropped image pays for one more copy."""
        copies = [p for p in self._pool.templates_dir.glob(_IMAGE_PREFIX + "*") if p.is_dir() and p != keep]
        copies.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in copies[max(0, self.image_copies - 1):]:
            self._pool.remove_template(old.name)

"""Where a VM's disk and RAM live: the storage strategy plugged into :class:`QemuRuntime`.

* :class:`WorkdirStorage`: the disk is a private copy of the image (a reflink where the filesystem can)
  inside the VM's work directory and the RAM is anonymous memory. Nothing to snapshot from.
* :class:`PoolStorage`: everything on the node's :class:`~capsa.node.storage.pool.StoragePool`. The disk is
  a reflink of a pool copy of the image and the RAM a file mapped shared (``sandboxes/<sbx id>/``), so a
  snapshot reflinks both while the VM is stopped and its migration stream is only the device state.
  Restores clone (or privately map) a snapshot's files; snapshots and templates live in the pool too.

Privileges: a VM's disk and RAM belong to its own VM uid. Branches that map a snapshot's frozen RAM
privately need the kernel's permission to open that file read-write (QEMU 7.2 has no read-only private
mapping), so the file gets a group of its own and only those VMs join it; the mapping is private, so guests
never write the file, but a QEMU compromised from inside its guest could. Use ``RamMode.COPY`` where that
matters more than the ~0.1 s per clone it costs.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from capsa.node.runtime.base import RamMode, VMSpec
from capsa.node.runtime.snapshot.manifest import RAM_FILE, Snapshot, SnapshotError
from capsa.node.runtime.snapshot.mechanics import (
    RestorePlan,
    create_ram_file,
    memory_backend_args,
    plan_restore,
)
from capsa.node.runtime.workdir import VM_UID_BASE, VmDir
from capsa.node.storage.disks import private_disk
from capsa.node.storage.filecopy import CopyError, copy_file
from capsa.node.storage.pool import StoragePool

__all__ = ["PoolStorage", "VmFiles", "VmStorage", "WorkdirStorage"]

_SNAPSHOT_GID_COUNT = 1_000_000
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
    groups: tuple[int, ...] = ()
    """Supplementary groups QEMU needs for these files (a snapshot's frozen RAM)."""
    restore: RestorePlan | None = None
    """The snapshot state to load once QEMU is up (None: a cold boot)."""


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
                      owner: tuple[int, int] | None) -> VmFiles:
        """The disk and RAM of a VM restored from ``snapshot``."""
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
        disk = private_disk(spec.image.rootfs, vmdir.disk, size_mib=spec.disk_size_mib, owner=owner)
        return VmFiles(disk=disk.path, disk_cow=disk.cow, ram=None, shared_ram=False)

    def restore_files(self, sandbox_id: str, snapshot: Snapshot, spec: VMSpec, mode: RamMode,
                      owner: tuple[int, int] | None) -> VmFiles:
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
        self._grant_lock = threading.Lock()

    @property
    def pool(self) -> StoragePool:
        return self._pool

    def boot_files(self, sandbox_id: str, spec: VMSpec, vmdir: VmDir,
                   owner: tuple[int, int] | None) -> VmFiles:
        pool_dir = self._pool.sandbox_dir(sandbox_id, create=True, owner=owner)
        try:
            rootfs = self._pool_rootfs(spec)
            disk = private_disk(rootfs, pool_dir / "disk.img", size_mib=spec.disk_size_mib, owner=owner)
            ram = pool_dir / RAM_FILE
            create_ram_file(ram, spec.memory_mib, owner=owner)
        except BaseException:
            self._pool.remove_sandbox(sandbox_id)
            raise
        return VmFiles(disk=disk.path, disk_cow=disk.cow, ram=ram, shared_ram=True,
                       qemu_args=tuple(memory_backend_args(spec.memory_mib, ram, share=True)))

    def restore_files(self, sandbox_id: str, snapshot: Snapshot, spec: VMSpec, mode: RamMode,
                      owner: tuple[int, int] | None) -> VmFiles:
        pool_dir = self._pool.sandbox_dir(sandbox_id, create=True, owner=owner)
        try:
            plan = plan_restore(snapshot.path, pool_dir, clone=self._pool.clone, mode=mode, owner=owner,
                                memory_mib=spec.memory_mib, vcpus=spec.vcpus, image_digest=spec.image.digest)
            groups: tuple[int, ...] = ()
            if mode is RamMode.PRIVATE and owner is not None:
                with self._grant_lock:  # concurrent branches must agree on one group for the file
                    groups = self._grant_private_ram(snapshot)
        except BaseException:
            self._pool.remove_sandbox(sandbox_id)
            raise
        return VmFiles(disk=plan.disk, disk_cow=self._pool.cow, ram=plan.ram, shared_ram=plan.shared_ram,
                       qemu_args=tuple(plan.extra_args), groups=groups, restore=plan)

    def release(self, sandbox_id: str) -> None:
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

    @staticmethod
    def _grant_private_ram(snap: Snapshot) -> tuple[int, ...]:
        """Let VM uids open the frozen RAM file (they map it privately): a group only they join."""
        if snap.manifest.ram is None:
            return ()
        ram = snap.path / RAM_FILE
        gid = ram.stat().st_gid
        if gid == 0:
            # A range of its own, below the VM uids, so no VM's own uid/gid can ever be this group.
            gid = VM_UID_BASE - 1 - secrets.randbelow(_SNAPSHOT_GID_COUNT)
            os.chown(ram, 0, gid)
        os.chmod(ram, 0o660)
        os.chmod(snap.path, 0o711)
        return (gid,)

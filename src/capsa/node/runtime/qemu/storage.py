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

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from capsa.node.runtime.base import RamMode, VMSpec
from capsa.node.runtime.ids import IdAllocator
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

__all__ = ["RAM_GID_BASE", "RAM_GID_COUNT", "PoolStorage", "VmFiles", "VmStorage", "WorkdirStorage"]

# Groups of frozen RAM files that branches map privately: a range of their own right below the VM uids,
# so no VM's own uid/gid can ever be one of them.
RAM_GID_COUNT = 1_000_000
RAM_GID_BASE = VM_UID_BASE - RAM_GID_COUNT
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
    private_ram: bool = False
    """The RAM is the sandbox's own clone mapped privately (:attr:`RamMode.CLONE`)."""


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
        disk = private_disk(spec.rootfs or spec.image.rootfs, vmdir.disk, size_mib=spec.disk_size_mib,
                            owner=owner)
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
        self.ram_gids = IdAllocator(RAM_GID_BASE, RAM_GID_COUNT, "branch RAM group")
        # Frozen RAM file -> the sandboxes mapping it privately; the last one gone revokes the group.
        self._ram_users: dict[Path, set[str]] = {}

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
                      owner: tuple[int, int] | None) -> VmFiles:
        pool_dir = self._pool.sandbox_dir(sandbox_id, create=True)
        try:
            # A snapshot's files are the node's own: anything else under their names was planted.
            clone = functools.partial(self._pool.clone, source_owner=os.geteuid())
            plan = plan_restore(snapshot.path, pool_dir, clone=clone, mode=mode, owner=owner,
                                memory_mib=spec.memory_mib, vcpus=spec.vcpus, image_digest=spec.image.digest)
            groups: tuple[int, ...] = ()
            if mode is RamMode.PRIVATE and owner is not None:
                groups = self._grant_private_ram(snapshot, sandbox_id)
        except BaseException:
            self._revoke_private_ram(sandbox_id)
            self._pool.remove_sandbox(sandbox_id)
            raise
        return VmFiles(disk=plan.disk, disk_cow=self._pool.cow, ram=plan.ram, shared_ram=plan.shared_ram,
                       qemu_args=tuple(plan.extra_args), groups=groups, restore=plan,
                       private_ram=mode is RamMode.CLONE)

    def release(self, sandbox_id: str) -> None:
        self._revoke_private_ram(sandbox_id)
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

    def _ram_gids_on_disk(self) -> set[int]:
        """Groups of frozen RAM files in the pool (granted by this or a previous node process)."""
        found: set[int] = set()
        for area in (self._pool.snapshots_dir, self._pool.templates_dir):
            for ram in area.glob(f"*/{RAM_FILE}"):
                with contextlib.suppress(OSError):
                    gid = ram.lstat().st_gid
                    if self.ram_gids.owns(gid):
                        found.add(gid)
        return found

    def _grant_private_ram(self, snap: Snapshot, sandbox_id: str) -> tuple[int, ...]:
        """Let the VM of ``sandbox_id`` open the frozen RAM file (it maps it privately) through a group
        that only the VMs branched from this file join; no other snapshot's branches share it."""
        if snap.manifest.ram is None:
            return ()
        ram = snap.path / RAM_FILE
        with self._grant_lock:  # concurrent branches must agree on one group for the file
            fd = os.open(ram, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if st.st_uid != 0:
                    raise SnapshotError(f"{ram} is not owned by the node (uid {st.st_uid})",
                                        code="snapshot_corrupt")
                gid = st.st_gid
                users = self._ram_users.setdefault(ram, set())
                if not self.ram_gids.owns(gid) or (not users and gid in self.ram_gids):
                    gid = self.ram_gids.allocate(taken=self._ram_gids_on_disk())
                elif gid not in self.ram_gids:
                    self.ram_gids.claim(gid)  # granted by a previous node process
                os.fchown(fd, 0, gid)
                os.fchmod(fd, 0o660)
            finally:
                os.close(fd)
            users.add(sandbox_id)
        os.chmod(snap.path, 0o711)
        return (gid,)

    def _revoke_private_ram(self, sandbox_id: str) -> None:
        """Drop ``sandbox_id`` from the users of a frozen RAM file; the last one takes the group back
        (the file is root's alone again and the group is free for another branch set)."""
        with self._grant_lock:
            for ram, users in list(self._ram_users.items()):
                if sandbox_id not in users:
                    continue
                users.discard(sandbox_id)
                if users:
                    continue
                del self._ram_users[ram]
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(ram, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        gid = os.fstat(fd).st_gid
                        os.fchmod(fd, 0o600)
                        os.fchown(fd, 0, 0)
                    finally:
                        os.close(fd)
                    self.ram_gids.release(gid)

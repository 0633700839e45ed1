"""The node's storage pool: where templates, per-sandbox files and snapshots live.

The pool is a directory on a copy-on-write filesystem so that a sandbox disk or a snapshot's memory
file is a reflink of its template (milliseconds, no space) rather than a copy. When no btrfs path is
configured the node formats a sparse loop file under its state dir and mounts it. When CoW is not
available at all the pool still works with sparse plain copies and says so once, loudly.

Layout under the pool root::

    templates/<name>/      template snapshots (disk + memory + device state + manifest)
    sandboxes/<sbx id>/    a running sandbox's private disk and RAM file
    snapshots/<snap id>/   session snapshots

Modes (the node runs as root; QEMU runs as a per-VM uid that may be compromised): the loop file and
every file the node makes are 0600 root; directories are root-owned 0711 (searchable, not listable), so
a VM uid can open its own disk and RAM file by name but cannot list, create, rename or remove anything,
including the entries of its own sandbox directory. Only the files inside ``sandboxes/<sbx id>/`` belong
to that sandbox's VM user. Copies read their source through
:func:`~capsa.node.storage.filecopy.open_source` (no symlinks, regular files on the pool's filesystem,
of the expected owner).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from capsa.common.errors import CapsaError
from capsa.common.layout import Below
from capsa.common.settings import Settings
from capsa.node.storage.filecopy import SourceCheck, copy_file, probe_reflink
from capsa.node.storage.mounts import (
    MountError,
    create_btrfs_image,
    filesystem_of,
    mount_loop,
    mounts,
    unmount,
)

__all__ = ["PoolUsage", "StorageError", "StoragePool", "StorageSettings"]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_AREAS = ("templates", "sandboxes", "snapshots")
_DOOMED = ".del-"
"""Infix of a tree renamed aside to be deleted (:meth:`StoragePool._remove`)."""


class StorageError(CapsaError):
    code = "storage_error"
    status = 500


class StorageSettings(BaseSettings):
    """``CAPSA_STORAGE_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="CAPSA_STORAGE_", extra="ignore")

    path: Path | None = None
    """An existing directory to use as the pool root (ideally on btrfs). None: a loop file in state_dir."""
    loop_size_mib: int = 64 * 1024
    """Apparent size of the loop file; it is sparse, so this is a ceiling, not an allocation."""
    require_cow: bool = False
    """Fail instead of falling back to plain copies when the pool cannot reflink."""
    min_free_mib: Annotated[int, Field(ge=0)] = 2048
    """Free space the pool keeps (``CAPSA_STORAGE_MIN_FREE_MIB``): a snapshot, pause, restore or branch
    that could leave less (counting the RAM size of what it writes) is refused with ``storage_full``
    (507) instead of running the pool into ENOSPC. 0: no floor."""


@dataclass(frozen=True)
class PoolUsage:
    total_bytes: int
    free_bytes: int


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    # Two node processes starting together must not both format or mount the loop file.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _restrict_image(image: Path) -> None:
    fd = os.open(image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{image} is not a regular file")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _check_name(kind: str, name: str) -> str:
    if not _NAME_RE.match(name):
        raise StorageError(f"invalid {kind} name {name!r}", code="invalid_name", status=422)
    return name


class StoragePool:
    """A pool root with its layout and CoW capability. Create with :meth:`open`."""

    def __init__(self, root: Path, *, cow: bool, fstype: str, loop_image: Path | None,
                 warning: str | None, mounted_here: bool = False) -> None:
        self.root = root
        self.mounted_here = mounted_here
        """This open mounted the loop filesystem (it was not mounted yet): a short-lived user such as the
        ``capsa template`` CLI unmounts it again when done, and leaves a node's mount alone."""
        self.cow = cow
        self.fstype = fstype
        self.loop_image = loop_image
        self.warning = warning
        self.device = os.stat(root).st_dev
        """The pool filesystem's ``st_dev``: every clone source must be on it."""

    # -- opening and closing -------------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path, settings: StorageSettings | None = None) -> StoragePool:
        """Find or create the pool. Mounts the loop filesystem if needed (idempotent across processes)."""
        cfg = settings if settings is not None else StorageSettings()
        if cfg.path is not None:
            return cls._open_directory(cfg.path, cfg)
        return cls._open_loop(state_dir, cfg)

    @classmethod
    def from_settings(cls, settings: Settings | None = None,
                      storage: StorageSettings | None = None) -> StoragePool:
        return cls.open((settings or Settings()).state_dir, storage)

    @classmethod
    def _open_directory(cls, path: Path, cfg: StorageSettings) -> StoragePool:
        if not path.exists():
            raise StorageError(f"storage path {path} does not exist")
        if not path.is_dir():
            raise StorageError(f"storage path {path} is not a directory")
        return cls._finish(path.resolve(), cfg, loop_image=None)

    @classmethod
    def _open_loop(cls, state_dir: Path, cfg: StorageSettings) -> StoragePool:
        storage_dir = state_dir / "storage"
        # 0711 down to the sandbox directories: unprivileged QEMU processes must reach their own disk and
        # RAM files (in directories they own) without being able to list anyone else's.
        storage_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(storage_dir, 0o711)
        image = storage_dir / "pool.btrfs"
        mount_point = storage_dir / "pool"
        with _locked(storage_dir / ".lock"):
            mounted = next((m for m in reversed(mounts()) if m.mount_point == mount_point.resolve()), None)
            if mounted is not None:
                if mounted.fstype != "btrfs":
                    raise StorageError(
                        f"{mount_point} is already mounted with {mounted.fstype}, expected the btrfs pool"
                    )
                os.chmod(mount_point, 0o711)
                _restrict_image(image)
                return cls._finish(mount_point.resolve(), cfg, loop_image=image)
            mount_point.mkdir(exist_ok=True, mode=0o711)
            created = False
            try:
                if not image.exists():
                    create_btrfs_image(image, cfg.loop_size_mib)
                    created = True
                # Every tenant's disks, RAM and snapshots are in there: root's alone (also an image
                # left 0644 by an older node).
                _restrict_image(image)
                mount_loop(image, mount_point)
            except MountError as exc:
                if created:
                    with contextlib.suppress(FileNotFoundError):
                        image.unlink()
                if cfg.require_cow:
                    raise StorageError(f"cannot set up the btrfs storage pool: {exc.message}") from exc
                # Not fatal: a plain directory works, only copies get slower and bigger.
                fallback = storage_dir / "plain"
                fallback.mkdir(exist_ok=True, mode=0o711)
                pool = cls._finish(fallback.resolve(), cfg, loop_image=None,
                                   reason=f"btrfs loop pool unavailable ({exc.message})")
                return pool
            os.chmod(mount_point, 0o711)  # the new filesystem's root directory
            log.info("storage.loop_mounted", extra={"image": str(image), "mount_point": str(mount_point),
                                                    "size_mib": cfg.loop_size_mib, "image_created": created})
            return cls._finish(mount_point.resolve(), cfg, loop_image=image, mounted_here=True)

    @classmethod
    def _finish(cls, root: Path, cfg: StorageSettings, *, loop_image: Path | None,
                reason: str | None = None, mounted_here: bool = False) -> StoragePool:
        for area in _AREAS:
            (root / area).mkdir(exist_ok=True, mode=0o711)
            os.chmod(root / area, 0o711)
        fs = filesystem_of(root)
        cow = probe_reflink(root)
        warning: str | None = None
        if not cow:
            why = reason or f"{root} is on {fs.fstype}, which cannot reflink"
            if cfg.require_cow:
                raise StorageError(f"storage pool has no copy-on-write support: {why}")
            warning = (f"{why}; sandbox disks and snapshots will be full (sparse) copies: slower to "
                       "create and using more space. Configure a btrfs path (CAPSA_STORAGE_PATH) "
                       "to fix this.")
            log.warning("storage.no_cow", extra={"root": str(root), "fstype": fs.fstype, "detail": warning})
        return cls(root, cow=cow, fstype=fs.fstype, loop_image=loop_image, warning=warning,
                   mounted_here=mounted_here)

    def unmount(self, *, lazy: bool = False) -> None:
        """Unmount the loop filesystem this pool lives on (no-op for a configured directory).

        A plain unmount returns once the filesystem is written out and its loop device detached, so a node
        that exits after it leaves nothing attached. ``lazy``: when the plain one fails (something still
        holds a file in the pool), detach it lazily instead (the loop device then goes with the last
        holder). A lazy unmount first returned at once and left the loop device attached for as long as
        btrfs took to write out what a pause had just written (seen past 60 s on a loaded host)."""
        if self.loop_image is None:
            return
        lock = self.loop_image.parent / ".lock"
        with _locked(lock):
            if any(m.mount_point == self.root for m in mounts()):
                try:
                    unmount(self.root)
                except MountError:
                    if not lazy:
                        raise
                    log.warning("storage.pool_busy", extra={"mount_point": str(self.root)})
                    unmount(self.root, lazy=True)
                log.info("storage.loop_unmounted", extra={"mount_point": str(self.root)})

    def destroy(self) -> None:
        """Unmount and delete the loop file with everything in it. For tests and uninstall only."""
        if self.loop_image is None:
            raise StorageError("destroy() only applies to a loop-file pool; "
                               "remove a configured path yourself")
        self.unmount()
        with contextlib.suppress(FileNotFoundError):
            self.loop_image.unlink()
        with contextlib.suppress(OSError):
            self.root.rmdir()

    # -- layout --------------------------------------------------------------------------------------

    templates_dir = Below("templates")
    sandboxes_dir = Below("sandboxes")
    snapshots_dir = Below("snapshots")

    def template_dir(self, name: str) -> Path:
        return self.templates_dir / _check_name("template", name)

    def sandbox_dir(self, sandbox_id: str, *, create: bool = False) -> Path:
        """The directory for one sandbox's files: root's, 0711, so its VM user reaches the files in it that
        it owns but can never replace one with a link to a file of the host's (the node clones them)."""
        path = self.sandboxes_dir / _check_name("sandbox", sandbox_id)
        if create:
            path.mkdir(mode=0o711, exist_ok=True)
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise StorageError(f"{path} is not a directory of the node's", code="unsafe_path")
            os.chmod(path, 0o711)
        return path

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.snapshots_dir / _check_name("snapshot", snapshot_id)

    @staticmethod
    def _entries(area: Path) -> list[str]:
        return sorted(p.name for p in area.iterdir() if p.is_dir() and not p.name.startswith("."))

    def list_sandboxes(self) -> list[str]:
        return self._entries(self.sandboxes_dir)

    def list_snapshots(self) -> list[str]:
        return self._entries(self.snapshots_dir)

    def list_templates(self) -> list[str]:
        return self._entries(self.templates_dir)

    # -- copies and cleanup --------------------------------------------------------------------------

    def clone(self, src: Path, dst: Path, *, overwrite: bool = False, source_owner: int | None = None,
              chown: tuple[int, int] | None = None) -> bool:
        """Reflink (or, without CoW, sparse-copy) ``src`` to ``dst``. Returns True if extents are shared.

        ``src`` must be a regular file (not a symlink) on the pool's filesystem, owned by ``source_owner``
        when given (else :class:`~capsa.node.storage.filecopy.UnsafeSource`); ``chown``: the copy's
        (uid, gid), set before it appears under its name."""
        return copy_file(src, dst, cow=self.cow, overwrite=overwrite, chown=chown,
                         check=SourceCheck(owner=source_owner, device=self.device))

    def _remove(self, path: Path) -> bool:
        """Delete ``path``; False when it is not there. Two callers removing the same path at once (two
        control-plane replicas pruning one snapshot) both succeed and exactly one gets True: the path is
        first renamed aside (atomic; the loser finds it gone) and the renamed tree deleted."""
        if not path.exists():
            return False
        # Never follow a symlink out of the pool.
        if path.is_symlink() or self.root not in path.resolve().parents:
            raise StorageError(f"refusing to remove {path}: not inside the pool")
        doomed = path.with_name(f".{path.name}{_DOOMED}{os.urandom(4).hex()}")
        try:
            path.rename(doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed)
        return True

    def remove_sandbox(self, sandbox_id: str) -> bool:
        return self._remove(self.sandbox_dir(sandbox_id))

    def remove_snapshot(self, snapshot_id: str) -> bool:
        return self._remove(self.snapshot_dir(snapshot_id))

    def remove_template(self, name: str) -> bool:
        return self._remove(self.template_dir(name))

    def prune_sandboxes(self, keep: set[str]) -> list[str]:
        """Delete every sandbox directory whose id is not in ``keep`` (e.g. after a node crash)."""
        removed = []
        for name in self.list_sandboxes():
            if name not in keep:
                self._remove(self.sandboxes_dir / name)
                removed.append(name)
        # Half-written temp copies from an interrupted clone, trees a crash left half deleted.
        for area in _AREAS:
            for p in (self.root / area).glob(".*.tmp-*"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            for p in (self.root / area).glob(f".*{_DOOMED}*"):
                shutil.rmtree(p, ignore_errors=True)
        return removed

    def usage(self) -> PoolUsage:
        """The pool's size and free space. A loop pool's file is sparse: what its filesystem reports free
        can be more than the filesystem under the file still has, so the smaller of the two counts."""
        du = shutil.disk_usage(self.root)
        free = du.free
        if self.loop_image is not None:
            free = min(free, shutil.disk_usage(self.loop_image.parent).free)
        return PoolUsage(total_bytes=du.total, free_bytes=free)

    def free_bytes(self) -> int:
        """Free space once the pool's filesystem has written back what it holds in memory: btrfs counts
        written data as used only when it allocates it at writeback, so right after large writes (a guest's
        disk, a snapshot) the bare figure still counts them as free. Blocks while the writeback runs."""
        _syncfs(self.root)
        return self.usage().free_bytes

    def __repr__(self) -> str:
        return f"StoragePool(root={str(self.root)!r}, fstype={self.fstype!r}, cow={self.cow})"


_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(path: Path) -> None:
    """Write back the dirty data of the filesystem holding ``path`` (syncfs(2): the standard library has
    :func:`os.sync`, for every filesystem, and :func:`os.fsync`, for one file, not this)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)

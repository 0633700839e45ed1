"""Private per-sandbox disks: a copy-on-write clone of an image when the filesystem can, a copy otherwise."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DiskCopy", "DiskError", "private_disk"]

_log = logging.getLogger(__name__)

# linux/fs.h: _IOW(0x94, 9, int). Clones every extent of the source into the destination (btrfs, XFS).
_FICLONE = 0x40049409
# errnos meaning "this filesystem (pair) cannot share extents", as opposed to a real I/O failure.
_NO_CLONE_ERRNOS = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}


class DiskError(Exception):
    """Making the private disk failed (missing image, full filesystem, bad size)."""


@dataclass(frozen=True)
class DiskCopy:
    path: Path
    cow: bool
    """True when the copy shares extents with the image (reflink); False for a full (sparse) copy."""
    size: int


def _clone(src: Path, dst: Path) -> bool:
    """Reflink ``src`` to a new ``dst``; False (and no ``dst``) when the filesystem cannot."""
    with open(src, "rb") as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.ioctl(fd, _FICLONE, fin.fileno())
        except OSError as exc:
            os.close(fd)
            dst.unlink(missing_ok=True)
            if exc.errno in _NO_CLONE_ERRNOS:
                return False
            raise
        os.close(fd)
    return True


def _full_copy(src: Path, dst: Path) -> None:
    # cp keeps holes (the images are mostly empty sparse files), which a naive read/write loop would fill.
    proc = subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", "--", str(src), str(dst)],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        dst.unlink(missing_ok=True)
        raise DiskError(f"copying {src} to {dst} failed: {proc.stderr.strip()}")


def _grow_ext4(path: Path, size_mib: int) -> None:
    os.truncate(path, size_mib * 1024 * 1024)
    proc = subprocess.run(["resize2fs", "-f", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DiskError(f"resize2fs of {path} to {size_mib} MiB failed: {proc.stderr.strip()}")


def private_disk(image: Path, dst: Path, *, size_mib: int | None = None, owner: tuple[int, int] | None = None,
                 ) -> DiskCopy:
    """Give a VM its own writable copy of ``image`` at ``dst`` (which must not exist).

    ``size_mib`` grows the copy (and its ext4 filesystem) and may not shrink it. ``owner`` (uid, gid) makes
    the copy writable by an unprivileged QEMU. On any failure ``dst`` is removed.
    """
    try:
        src_size = image.stat().st_size
    except FileNotFoundError:
        raise DiskError(f"image {image} does not exist") from None
    if size_mib is not None and size_mib * 1024 * 1024 < src_size:
        raise DiskError(f"disk size {size_mib} MiB is smaller than the image "
                        f"({src_size // (1024 * 1024)} MiB)")
    if dst.exists():
        raise DiskError(f"{dst} already exists")
    try:
        cow = _clone(image, dst)
        if not cow:
            _log.warning("no copy-on-write on %s: making a full copy of %s (slower, uses more disk)",
                         dst.parent, image)
            _full_copy(image, dst)
        os.chmod(dst, 0o600)
        if size_mib is not None and size_mib * 1024 * 1024 > src_size:
            _grow_ext4(dst, size_mib)
        if owner is not None:
            os.chown(dst, owner[0], owner[1])
        return DiskCopy(path=dst, cow=cow, size=dst.stat().st_size)
    except OSError as exc:
        dst.unlink(missing_ok=True)
        raise DiskError(f"making the private disk {dst} failed: {exc}") from exc
    except BaseException:
        dst.unlink(missing_ok=True)
        raise

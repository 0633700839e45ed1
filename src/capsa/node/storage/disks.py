"""Private per-sandbox disks: a copy-on-write clone of an image when the filesystem can, a copy otherwise.

The copying itself is :mod:`capsa.node.storage.filecopy`; this adds ownership, growing and the warning.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from capsa.node.storage.filecopy import CopyError, copy_file

__all__ = ["DiskCopy", "DiskError", "private_disk"]

_log = logging.getLogger(__name__)


class DiskError(Exception):
    """Making the private disk failed (missing image, full filesystem, bad size)."""


@dataclass(frozen=True)
class DiskCopy:
    path: Path
    cow: bool
    """True when the copy shares extents with the image (reflink); False for a full (sparse) copy."""
    size: int


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
        cow = copy_file(image, dst, cow=True, mode=0o600)
        if not cow:
            _log.warning("no copy-on-write on %s: made a full (sparse) copy of %s: slower, uses more disk",
                         dst.parent, image)
        if size_mib is not None and size_mib * 1024 * 1024 > src_size:
            _grow_ext4(dst, size_mib)
        if owner is not None:
            os.chown(dst, owner[0], owner[1])
        return DiskCopy(path=dst, cow=cow, size=dst.stat().st_size)
    except (OSError, CopyError) as exc:
        dst.unlink(missing_ok=True)
        raise DiskError(f"making the private disk {dst} failed: {exc}") from exc
    except BaseException:
        dst.unlink(missing_ok=True)
        raise

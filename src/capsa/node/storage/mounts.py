"""Mount table lookups and the btrfs loop filesystem a node creates when no btrfs path is configured."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from capsa.common.errors import CapsaError

__all__ = [
    "MIN_LOOP_SIZE_MIB",
    "MountError",
    "MountInfo",
    "create_btrfs_image",
    "filesystem_of",
    "mount_loop",
    "mounts",
    "unmount",
]

# mkfs.btrfs refuses devices below ~114 MiB with the default (DUP metadata) profile.
MIN_LOOP_SIZE_MIB = 128
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class MountError(CapsaError):
    code = "storage_error"
    status = 500


@dataclass(frozen=True)
class MountInfo:
    mount_point: Path
    fstype: str
    source: str
    options: tuple[str, ...]


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[MountInfo]:
    """The current mount namespace's mounts, in mount order."""
    result: list[MountInfo] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            tail = right.split()
            if len(fields) < 6 or len(tail) < 2:
                continue
            result.append(
                MountInfo(
                    mount_point=Path(_unescape(fields[4])),
                    fstype=tail[0],
                    source=_unescape(tail[1]),
                    options=tuple(fields[5].split(",")),
                )
            )
    return result


def filesystem_of(path: Path) -> MountInfo:
    """The mount that holds ``path`` (the last-mounted one with the longest matching prefix)."""
    target = path.resolve()
    best: MountInfo | None = None
    for m in mounts():
        inside = target == m.mount_point or m.mount_point in target.parents
        if inside and (best is None or len(m.mount_point.parts) >= len(best.mount_point.parts)):
            best = m
    if best is None:  # pragma: no cover - "/" is always mounted
        raise MountError(f"no filesystem holds {path}")
    return best


def _run(argv: list[str], what: str) -> None:
    exe = shutil.which(argv[0])
    if exe is None:
        raise MountError(f"{what}: {argv[0]} is not installed (install btrfs-progs / util-linux)")
    proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise MountError(f"{what} failed: {detail[-1] if detail else f'exit {proc.returncode}'}")


def create_btrfs_image(image: Path, size_mib: int) -> None:
    """Create a sparse file of ``size_mib`` and format it as btrfs. Removes the file on failure."""
    if size_mib < MIN_LOOP_SIZE_MIB:
        raise MountError(f"a btrfs pool needs at least {MIN_LOOP_SIZE_MIB} MiB, got {size_mib} MiB")
    if image.exists():
        raise MountError(f"refusing to format {image}: it already exists")
    try:
        # 0600: the image holds every sandbox's disk, RAM and snapshots.
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size_mib * 1024 * 1024)
        finally:
            os.close(fd)
        _run(["mkfs.btrfs", "-q", str(image)], f"mkfs.btrfs {image}")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            image.unlink()
        raise


def mount_loop(image: Path, mount_point: Path) -> None:
    """Mount a filesystem image through a loop device (auto-detached when unmounted)."""
    if os.geteuid() != 0:
        raise MountError(
            f"mounting {image} needs root; run the node as root or configure an existing btrfs "
            "directory (CAPSA_STORAGE_PATH)"
        )
    _run(["mount", "-o", "loop", str(image), str(mount_point)], f"mount {image} on {mount_point}")


def unmount(mount_point: Path, *, lazy: bool = False) -> None:
    argv = ["umount"]
    if lazy:
        argv.append("--lazy")
    _run([*argv, str(mount_point)], f"umount {mount_point}")

"""Private disk copies: reflink on btrfs (a real loop-mounted btrfs), full sparse copy elsewhere."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.node.storage.disks import DiskError, private_disk

MIB = 1024 * 1024


def _ext4_image(path: Path, size_mib: int = 64) -> None:
    content = path.parent / "content"
    content.mkdir()
    (content / "hello.txt").write_text("hello from the image\n")
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", str(content), str(path), f"{size_mib}M"],
                   check=True)


def _blocks(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_full_copy_on_ext4_keeps_holes_and_content(tmp_path: Path) -> None:
    image = tmp_path / "rootfs.ext4"
    _ext4_image(image)
    copy = private_disk(image, tmp_path / "disk.img")
    assert copy.cow is False  # the test directory is on ext4 here: no reflink
    assert copy.path.read_bytes() == image.read_bytes()
    assert _blocks(copy.path) < 32 * MIB  # still sparse
    assert copy.path.stat().st_mode & 0o777 == 0o600
    assert copy.size == 64 * MIB


@pytest.mark.root
def test_owner_and_grow(tmp_path: Path) -> None:
    image = tmp_path / "rootfs.ext4"
    _ext4_image(image)
    copy = private_disk(image, tmp_path / "disk.img", size_mib=96, owner=(1879048200, 1879048200))
    st = copy.path.stat()
    assert (st.st_uid, st.st_gid) == (1879048200, 1879048200)
    assert st.st_size == 96 * MIB
    fsck = subprocess.run(["e2fsck", "-fn", str(copy.path)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    info = subprocess.run(["dumpe2fs", "-h", str(copy.path)], capture_output=True, text=True,
                          check=True).stdout
    block_count = int(next(line for line in info.splitlines() if line.startswith("Block count:")).split()[-1])
    block_size = int(next(line for line in info.splitlines() if line.startswith("Block size:")).split()[-1])
    assert block_count * block_size == 96 * MIB  # the filesystem grew with the file
    assert image.stat().st_size == 64 * MIB  # the image is untouched


def test_bad_requests_leave_nothing(tmp_path: Path) -> None:
    image = tmp_path / "rootfs.ext4"
    _ext4_image(image)
    with pytest.raises(DiskError, match="does not exist"):
        private_disk(tmp_path / "missing.ext4", tmp_path / "a.img")
    with pytest.raises(DiskError, match="smaller than the image"):
        private_disk(image, tmp_path / "b.img", size_mib=10)
    (tmp_path / "c.img").write_text("taken")
    with pytest.raises(DiskError, match="already exists"):
        private_disk(image, tmp_path / "c.img")
    assert (tmp_path / "c.img").read_text() == "taken"
    with pytest.raises(DiskError):
        private_disk(image, tmp_path / "no-such-dir" / "d.img")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.img", "content", "rootfs.ext4"]


@pytest.fixture
def btrfs_dir(tmp_path: Path) -> Iterator[Path]:
    backing = tmp_path / "btrfs.img"
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with open(backing, "wb") as fh:
        fh.truncate(256 * MIB)
    subprocess.run(["mkfs.btrfs", "-q", str(backing)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(backing), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


@pytest.mark.root
def test_reflink_on_btrfs(btrfs_dir: Path) -> None:
    image = btrfs_dir / "rootfs.ext4"
    _ext4_image(image)
    copy = private_disk(image, btrfs_dir / "disk.img")
    assert copy.cow is True
    assert copy.path.read_bytes() == image.read_bytes()
    # Writing the copy must not change the image (copy-on-write, not a shared file).
    with open(copy.path, "r+b") as fh:
        fh.seek(MIB)
        fh.write(b"x" * 4096)
    assert copy.path.read_bytes() != image.read_bytes()

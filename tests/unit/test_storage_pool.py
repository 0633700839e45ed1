"""The storage pool and file copies, against a real btrfs loop filesystem and the host's ext4."""

from __future__ import annotations

import array
import fcntl
import os
import struct
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from capsa.node.storage import (
    CopyError,
    ReflinkUnsupported,
    StorageError,
    StoragePool,
    StorageSettings,
    copy_file,
    reflink,
    sparse_copy,
)
from capsa.node.storage.filecopy import SourceCheck, UnsafeSource, open_source
from capsa.node.storage.mounts import filesystem_of, mounts

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a loop btrfs needs root"),
]

MiB = 1024 * 1024
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_EXTENT_SHARED = 0x2000


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` whose extents the kernel reports as shared (FIEMAP), i.e. reflinked."""
    count = 64
    shared = 0
    start = 0
    with open(path, "rb") as f:
        while True:
            buf = array.array("B", bytes(32 + 56 * count))
            struct.pack_into("=QQLLLL", buf, 0, start, 2**64 - 1 - start, 1, 0, count, 0)
            fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf, True)
            mapped = struct.unpack_from("=L", buf, 20)[0]
            last = None
            for i in range(mapped):
                logical, _phys, length, _r1, _r2, flags = struct.unpack_from("=QQQQQL", buf, 32 + 56 * i)
                if flags & _FIEMAP_EXTENT_SHARED:
                    shared += length
                last = (logical, length, flags)
            if last is None or last[2] & 0x1:  # FIEMAP_EXTENT_LAST
                return shared
            start = last[0] + last[1]


@pytest.fixture
def btrfs_pool(tmp_path: Path) -> Iterator[StoragePool]:
    pool = StoragePool.open(tmp_path / "state", StorageSettings(loop_size_mib=512, require_cow=True))
    try:
        yield pool
    finally:
        pool.destroy()


def _loop_devices_for(image: Path) -> str:
    return subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True, check=True).stdout


def test_loop_pool_is_btrfs_with_cow_and_layout(btrfs_pool: StoragePool, tmp_path: Path) -> None:
    assert btrfs_pool.fstype == "btrfs"
    assert btrfs_pool.cow is True
    assert btrfs_pool.warning is None
    assert filesystem_of(btrfs_pool.root).fstype == "btrfs"
    assert btrfs_pool.loop_image == tmp_path / "state" / "storage" / "pool.btrfs"
    for area in ("templates", "sandboxes", "snapshots"):
        assert (btrfs_pool.root / area).is_dir()
    # The loop file is sparse: a 512 MiB pool costs only what mkfs wrote.
    assert btrfs_pool.loop_image.stat().st_blocks * 512 < 64 * MiB


def test_reopen_reuses_the_mount(btrfs_pool: StoragePool, tmp_path: Path) -> None:
    marker = btrfs_pool.templates_dir / "marker"
    marker.write_text("x")
    before = [m for m in mounts() if m.mount_point == btrfs_pool.root]
    again = StoragePool.open(tmp_path / "state", StorageSettings(loop_size_mib=512))
    after = [m for m in mounts() if m.mount_point == btrfs_pool.root]
    assert again.root == btrfs_pool.root and again.cow
    assert len(before) == len(after) == 1
    assert (again.templates_dir / "marker").read_text() == "x"


def test_unmount_and_destroy_leave_nothing(tmp_path: Path) -> None:
    pool = StoragePool.open(tmp_path / "s", StorageSettings(loop_size_mib=256))
    image = pool.loop_image
    assert image is not None and _loop_devices_for(image)
    pool.unmount()
    assert all(m.mount_point != pool.root for m in mounts())
    assert _loop_devices_for(image) == ""
    # Data survives an unmount/remount cycle.
    pool2 = StoragePool.open(tmp_path / "s", StorageSettings(loop_size_mib=256))
    (pool2.snapshots_dir / "keep").mkdir()
    pool2.unmount()
    pool3 = StoragePool.open(tmp_path / "s", StorageSettings(loop_size_mib=256))
    assert pool3.list_snapshots() == ["keep"]
    pool3.destroy()
    assert not image.exists()
    assert _loop_devices_for(image) == ""
    assert all(m.mount_point != pool3.root for m in mounts())


def test_reflink_shares_extents_and_copies_are_independent(btrfs_pool: StoragePool) -> None:
    src = btrfs_pool.templates_dir / "disk.img"
    payload = os.urandom(8 * MiB)
    src.write_bytes(payload)
    os.sync()
    dst = btrfs_pool.sandboxes_dir / "disk.img"
    assert btrfs_pool.clone(src, dst) is True
    assert dst.read_bytes() == payload
    assert shared_bytes(dst) >= 8 * MiB
    with open(dst, "r+b") as f:
        f.write(b"changed")
    assert src.read_bytes() == payload
    assert dst.read_bytes()[:7] == b"changed"


def test_reflink_keeps_sparse_files_sparse(btrfs_pool: StoragePool) -> None:
    src = btrfs_pool.templates_dir / "sparse.img"
    with open(src, "wb") as f:
        f.truncate(1024 * MiB)
        f.seek(100 * MiB)
        f.write(b"data")
    dst = btrfs_pool.sandboxes_dir / "sparse.img"
    reflink(src, dst)
    assert dst.stat().st_size == 1024 * MiB
    assert dst.stat().st_blocks * 512 < 4 * MiB


def test_reflink_refuses_existing_destination_and_missing_source(btrfs_pool: StoragePool) -> None:
    src = btrfs_pool.templates_dir / "a"
    src.write_bytes(b"a")
    dst = btrfs_pool.templates_dir / "b"
    dst.write_bytes(b"b")
    with pytest.raises(CopyError, match="file exists"):
        reflink(src, dst)
    assert dst.read_bytes() == b"b"
    reflink(src, dst, overwrite=True)
    assert dst.read_bytes() == b"a"
    with pytest.raises(CopyError, match="no such file"):
        reflink(btrfs_pool.templates_dir / "missing", btrfs_pool.templates_dir / "c")
    with pytest.raises(CopyError, match="does not exist"):
        reflink(src, btrfs_pool.templates_dir / "nodir" / "c")
    assert sorted(p.name for p in btrfs_pool.templates_dir.iterdir()) == ["a", "b"]


def test_reflink_across_filesystems_is_unsupported_and_leaves_nothing(
    btrfs_pool: StoragePool, tmp_path: Path
) -> None:
    src = btrfs_pool.templates_dir / "x"
    src.write_bytes(b"hello")
    outside = tmp_path / "out"
    outside.mkdir()
    with pytest.raises(ReflinkUnsupported):
        reflink(src, outside / "x")
    assert list(outside.iterdir()) == []
    # copy_file falls back to a real copy.
    assert copy_file(src, outside / "x") is False
    assert (outside / "x").read_bytes() == b"hello"


def test_sparse_copy_on_ext4_keeps_holes(tmp_path: Path) -> None:
    assert filesystem_of(tmp_path).fstype != "btrfs"
    src = tmp_path / "src.img"
    blob = os.urandom(MiB)
    with open(src, "wb") as f:
        f.truncate(256 * MiB)
        f.seek(3 * MiB)
        f.write(blob)
        f.seek(200 * MiB)
        f.write(blob)
    dst = tmp_path / "dst.img"
    sparse_copy(src, dst)
    assert dst.stat().st_size == 256 * MiB
    assert dst.stat().st_blocks * 512 <= 4 * MiB
    with open(dst, "rb") as f:
        assert f.read(3 * MiB) == bytes(3 * MiB)
        assert f.read(MiB) == blob
        f.seek(200 * MiB)
        assert f.read(MiB) == blob
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sparse_copy_of_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    sparse_copy(tmp_path / "empty", tmp_path / "empty2")
    assert (tmp_path / "empty2").read_bytes() == b""


def test_directory_without_cow_warns_and_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    root.mkdir()
    pool = StoragePool.open(tmp_path / "state", StorageSettings(path=root))
    assert pool.cow is False
    assert pool.warning is not None and "copies" in pool.warning and "CAPSA_STORAGE_PATH" in pool.warning
    src = pool.templates_dir / "disk"
    src.write_bytes(b"disk")
    assert pool.clone(src, pool.sandboxes_dir / "disk") is False
    assert (pool.sandboxes_dir / "disk").read_bytes() == b"disk"
    with pytest.raises(StorageError, match="no copy-on-write"):
        StoragePool.open(tmp_path / "state", StorageSettings(path=root, require_cow=True))


def test_configured_btrfs_directory_is_used_as_is(btrfs_pool: StoragePool, tmp_path: Path) -> None:
    sub = btrfs_pool.root / "elsewhere"
    sub.mkdir()
    pool = StoragePool.open(tmp_path / "other-state", StorageSettings(path=sub, require_cow=True))
    assert pool.root == sub and pool.cow and pool.loop_image is None
    assert not (tmp_path / "other-state").exists()
    pool.unmount()  # no-op for a configured directory
    with pytest.raises(StorageError, match="loop-file pool"):
        pool.destroy()


def test_bad_paths_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        StoragePool.open(tmp_path, StorageSettings(path=tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(StorageError, match="not a directory"):
        StoragePool.open(tmp_path, StorageSettings(path=tmp_path / "file"))


def test_too_small_loop_file_fails_cleanly(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(StorageError, match="at least"):
        StoragePool.open(state, StorageSettings(loop_size_mib=16, require_cow=True))
    assert not (state / "storage" / "pool.btrfs").exists()
    assert all(state not in m.mount_point.parents for m in mounts())
    # Without require_cow the node still gets a usable (plain) pool and a warning saying why.
    pool = StoragePool.open(state, StorageSettings(loop_size_mib=16))
    assert pool.cow is False
    assert pool.warning is not None and "btrfs loop pool unavailable" in pool.warning
    assert not (state / "storage" / "pool.btrfs").exists()


def test_names_are_validated(btrfs_pool: StoragePool) -> None:
    for bad in ("../escape", ".hidden", "a/b", "", "x" * 200):
        with pytest.raises(StorageError) as info:
            btrfs_pool.sandbox_dir(bad)
        assert info.value.code == "invalid_name"
    assert btrfs_pool.sandbox_dir("sbx_abc", create=True).is_dir()


def test_remove_and_prune(btrfs_pool: StoragePool) -> None:
    for sid in ("sbx_a", "sbx_b", "sbx_c"):
        d = btrfs_pool.sandbox_dir(sid, create=True)
        (d / "disk.img").write_bytes(b"x" * 4096)
    (btrfs_pool.sandboxes_dir / ".disk.img.tmp-deadbeef").write_bytes(b"half")
    assert btrfs_pool.remove_sandbox("sbx_a") is True
    assert btrfs_pool.remove_sandbox("sbx_a") is False
    assert btrfs_pool.prune_sandboxes(keep={"sbx_b"}) == ["sbx_c"]
    assert sorted(p.name for p in btrfs_pool.sandboxes_dir.iterdir()) == ["sbx_b"]
    snap = btrfs_pool.snapshot_dir("snap_1")
    snap.mkdir()
    assert btrfs_pool.list_snapshots() == ["snap_1"]
    assert btrfs_pool.remove_snapshot("snap_1") is True
    assert btrfs_pool.list_snapshots() == []


def test_removing_one_snapshot_twice_at_once_succeeds_once(btrfs_pool: StoragePool) -> None:
    """Two replicas' reapers may prune the same rolling snapshot at the same moment: neither may fail."""
    for round_ in range(10):
        sid = f"snap_twice{round_}"
        snap = btrfs_pool.snapshot_dir(sid)
        for d in range(20):
            (snap / f"d{d}").mkdir(parents=True)
            for f in range(20):
                (snap / f"d{d}" / f"f{f}").write_bytes(b"x")
        start = threading.Barrier(2)

        def remove(sid: str = sid, start: threading.Barrier = start) -> bool:
            start.wait()
            return btrfs_pool.remove_snapshot(sid)

        with ThreadPoolExecutor(2) as pool:
            results = sorted(pool.map(lambda _: remove(), range(2)))
        assert results == [False, True], round_
    assert btrfs_pool.list_snapshots() == [] and list(btrfs_pool.snapshots_dir.iterdir()) == []


def test_prune_deletes_trees_a_crash_left_half_deleted(btrfs_pool: StoragePool) -> None:
    half = btrfs_pool.snapshots_dir / ".snap_gone.del-0a1b2c3d"
    (half / "memory").mkdir(parents=True)
    assert btrfs_pool.prune_sandboxes(keep=set()) == [] and not half.exists()


def test_remove_refuses_symlinks_out_of_the_pool(btrfs_pool: StoragePool, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    (btrfs_pool.sandboxes_dir / "sbx_link").symlink_to(victim)
    with pytest.raises(StorageError, match="refusing"):
        btrfs_pool.remove_sandbox("sbx_link")
    assert (victim / "precious").read_text() == "keep"


# -- modes and hostile sources (issue 9, findings 0 and 1) ------------------------------------------------


def test_loop_file_and_pool_directories_are_root_only(btrfs_pool: StoragePool, tmp_path: Path) -> None:
    image = btrfs_pool.loop_image
    assert image is not None
    st = image.stat()
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o600")
    assert oct((tmp_path / "state" / "storage").stat().st_mode & 0o7777) == "0o711"
    areas = (btrfs_pool.templates_dir, btrfs_pool.sandboxes_dir, btrfs_pool.snapshots_dir)
    for path in (btrfs_pool.root, *areas):
        assert (path.stat().st_uid, oct(path.stat().st_mode & 0o7777)) == (0, "0o711"), path
    # A sandbox directory stays root's: its VM user may own files in it, never the entries.
    sdir = btrfs_pool.sandbox_dir("sbx_modes", create=True)
    assert (sdir.stat().st_uid, oct(sdir.stat().st_mode & 0o7777)) == (0, "0o711")


def test_an_image_left_world_readable_is_closed_on_the_next_open(tmp_path: Path) -> None:
    settings = StorageSettings(loop_size_mib=512, require_cow=True)
    pool = StoragePool.open(tmp_path / "state", settings)
    try:
        assert pool.loop_image is not None
        pool.unmount()
        pool.loop_image.chmod(0o644)  # as an older node made it
        again = StoragePool.open(tmp_path / "state", settings)
        assert oct(pool.loop_image.stat().st_mode & 0o7777) == "0o600"
        assert again.root == pool.root
    finally:
        pool.destroy()


def test_clone_refuses_a_symlink_planted_in_place_of_the_source(btrfs_pool: StoragePool) -> None:
    secret = btrfs_pool.root / "secret.key"
    secret.write_bytes(b"host secret")
    sdir = btrfs_pool.sandbox_dir("sbx_link", create=True)
    (sdir / "disk.img").symlink_to(secret)
    with pytest.raises(UnsafeSource, match="symbolic link"):
        btrfs_pool.clone(sdir / "disk.img", btrfs_pool.snapshots_dir / "disk.img")
    assert list(btrfs_pool.snapshots_dir.iterdir()) == []  # no copy, no temp file


def test_clone_checks_owner_type_and_filesystem_on_the_open_file(btrfs_pool: StoragePool,
                                                                 tmp_path: Path) -> None:
    sdir = btrfs_pool.sandbox_dir("sbx_checks", create=True)
    disk = sdir / "disk.img"
    disk.write_bytes(b"guest disk")
    vm_uid = 1_879_048_200
    # Root's file where the VM user's should be (e.g. a hard link to a host file): refused.
    with pytest.raises(UnsafeSource, match="owned by uid 0"):
        btrfs_pool.clone(disk, btrfs_pool.snapshots_dir / "a.img", source_owner=vm_uid)
    os.chown(disk, vm_uid, vm_uid)
    assert btrfs_pool.clone(disk, btrfs_pool.snapshots_dir / "a.img", source_owner=vm_uid) is True
    copy = btrfs_pool.snapshots_dir / "a.img"
    assert copy.read_bytes() == b"guest disk" and copy.stat().st_uid == 0
    assert oct(copy.stat().st_mode & 0o7777) == "0o600"
    # chown: the copy belongs to the next VM user before it appears under its name.
    btrfs_pool.clone(disk, btrfs_pool.snapshots_dir / "b.img", source_owner=vm_uid,
                     chown=(vm_uid + 1, vm_uid + 1))
    assert (btrfs_pool.snapshots_dir / "b.img").stat().st_uid == vm_uid + 1
    # A FIFO never blocks the node and is refused.
    fifo = sdir / "memory.ram"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeSource, match="not a regular file"):
        btrfs_pool.clone(fifo, btrfs_pool.snapshots_dir / "c.ram")
    # A file on another filesystem (the host's) is not a pool file.
    outside = tmp_path / "outside.img"
    outside.write_bytes(b"host file")
    with pytest.raises(UnsafeSource, match="expected filesystem"):
        btrfs_pool.clone(outside, btrfs_pool.snapshots_dir / "d.img")
    leftovers = sorted(p.name for p in btrfs_pool.snapshots_dir.iterdir())
    assert leftovers == ["a.img", "b.img"], leftovers


def test_open_source_refuses_what_copy_file_must_not_read(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafeSource):
        copy_file(link, tmp_path / "out", cow=False)
    with pytest.raises(UnsafeSource):
        open_source(tmp_path)  # a directory
    fd, st = open_source(target, SourceCheck(owner=0, device=target.stat().st_dev))
    os.close(fd)
    assert st.st_size == 1


def test_free_space_counts_data_not_yet_written_back(btrfs_pool: StoragePool) -> None:
    """The floor reads free space right after large writes (a guest's disk, a snapshot): btrfs counts data
    as used only once writeback allocated it, so the bare figure counted them as free (issue 27's floor then
    let a snapshot through that failed with ENOSPC half-way)."""
    before = btrfs_pool.free_bytes()
    with open(btrfs_pool.root / "unsynced", "wb") as f:
        f.write(os.urandom(100 * 1024 * 1024))  # no fsync: in the page cache only
    assert before - btrfs_pool.free_bytes() >= 90 * 1024 * 1024

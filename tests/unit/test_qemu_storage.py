"""The QEMU runtime's storage strategies and its snapshot surface, without booting a VM."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.base import Accelerator, RamMode, Runtime, SnapshotCapable, VMSpec
from capsa.node.runtime.hostinfo import HostInfoError, qemu_version
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, WorkdirStorage
from capsa.node.runtime.qemu.cmdline import machine_fingerprint
from capsa.node.runtime.snapshot.manifest import FileEntry, Snapshot, SnapshotError, SnapshotManifest
from capsa.node.runtime.workdir import VmDir
from capsa.node.storage.pool import StoragePool, StorageSettings


def _image(root: Path, name: str) -> GuestImage:
    img = root / name
    img.mkdir()
    for f in ("vmlinux", "initrd.cpio.gz"):
        (img / f).write_bytes(b"x" * 64)
    with open(img / "rootfs.ext4", "wb") as fh:
        fh.truncate(4 * 1024 * 1024)
    return GuestImage(kernel=img / "vmlinux", initrd=img / "initrd.cpio.gz", rootfs=img / "rootfs.ext4",
                      digest="sha256:" + name.encode().hex().ljust(64, "0"), kernel_release="none")


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[StoragePool]:
    root = tmp_path / "pool"
    root.mkdir()
    yield StoragePool.open(tmp_path / "state", StorageSettings(path=root))


def _runtime(tmp_path: Path, storage: PoolStorage | None = None, accel: str = "tcg") -> QemuRuntime:
    return QemuRuntime(Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache"), accel,
                       storage=storage, accel_cache=False, drop_privileges=False)


def _snapshot(path: Path, *, accel: str, machine: str | None, qemu: str | None) -> Snapshot:
    entry = FileEntry(path="state.bin", size=1)
    manifest = SnapshotManifest(id=new_id("snap"), created_at=SnapshotManifest.now(), memory_mib=256, vcpus=1,
                                accel=accel, image_digest="d", qemu_version=qemu, machine=machine,
                                device_state=entry, ram=None, disk=FileEntry(path="disk.img", size=1))
    return Snapshot(path, manifest.sealed())


def test_the_runtime_satisfies_both_protocols(tmp_path: Path, pool: StoragePool) -> None:
    for rt in (_runtime(tmp_path), _runtime(tmp_path, PoolStorage(pool))):
        assert isinstance(rt, SnapshotCapable)
        runtime: Runtime = rt
        assert runtime.name == "qemu"


def test_workdir_storage_refuses_snapshots_with_a_clear_code(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    assert rt.can_snapshot is False and isinstance(rt.storage, WorkdirStorage)
    assert rt.list_snapshot_ids() == []
    with pytest.raises(SnapshotError) as err:
        _ = rt.pool
    assert err.value.code == "snapshot_unsupported" and err.value.status == 409
    image = _image(tmp_path, "img")
    snap = _snapshot(tmp_path, accel="tcg", machine=None, qemu=None)
    with pytest.raises(SnapshotError) as err:
        rt.storage.restore_files("sbx_a", snap, VMSpec(image=image), RamMode.COPY, None)
    assert err.value.code == "snapshot_unsupported"


def test_open_snapshot_is_404_for_malformed_and_unknown_ids(tmp_path: Path, pool: StoragePool) -> None:
    rt = _runtime(tmp_path, PoolStorage(pool))
    for bad in ("../etc", "snap", "sbx_" + "a" * 20, new_id("snap")):
        with pytest.raises(CapsaError) as err:
            rt.open_snapshot(bad)
        assert err.value.code == "snapshot_not_found" and err.value.status == 404
    (pool.snapshots_dir / "not-a-snapshot-id").mkdir(parents=True)
    sid = new_id("snap")
    (pool.snapshots_dir / sid).mkdir()
    assert rt.list_snapshot_ids() == [sid]
    assert rt.delete_snapshot(sid) is True and rt.delete_snapshot(sid) is False


def test_pool_storage_lays_out_disk_and_shared_ram_and_releases_them(tmp_path: Path,
                                                                     pool: StoragePool) -> None:
    storage = PoolStorage(pool)
    image = _image(tmp_path, "one")
    vmdir = VmDir(tmp_path / "vms" / "sbx_one")
    files = storage.boot_files("sbx_one", VMSpec(image=image, memory_mib=64), vmdir, None)
    assert files.disk.parent == pool.sandbox_dir("sbx_one") and files.disk.stat().st_size == 4 * 1024 * 1024
    assert files.ram is not None and files.ram.stat().st_size == 64 * 1024 * 1024 and files.shared_ram
    assert any("share=on" in a and str(files.ram) in a for a in files.qemu_args)
    assert files.restore is None and files.fds == ()
    storage.release("sbx_one")
    assert not pool.sandbox_dir("sbx_one").exists()
    assert storage.prune(set()) == []


def test_pool_storage_keeps_only_the_newest_image_copies(tmp_path: Path, pool: StoragePool) -> None:
    storage = PoolStorage(pool, image_copies=2)
    for i, name in enumerate(("a", "b", "c")):
        image = _image(tmp_path, name)
        storage.boot_files(f"sbx_{name}", VMSpec(image=image), VmDir(tmp_path / "vms" / name), None)
        for d in pool.templates_dir.glob("image-*"):  # make the order of creation visible to mtime
            if d.name.endswith(image.digest.split(":")[-1][:32]):
                os.utime(d, (1000 + i, 1000 + i))
    copies = sorted(p.name for p in pool.templates_dir.glob("image-*"))
    assert len(copies) == 2
    assert sorted(storage.prune(set())) == ["sbx_a", "sbx_b", "sbx_c"]


def test_workdir_storage_puts_the_disk_in_the_vm_directory(tmp_path: Path) -> None:
    image = _image(tmp_path, "img")
    vmdir = VmDir(tmp_path / "vms" / "sbx_w")
    vmdir.create(None)
    files = WorkdirStorage().boot_files("sbx_w", VMSpec(image=image), vmdir, None)
    assert files.disk == vmdir.disk and files.disk.is_file()
    assert files.ram is None and not files.shared_ram and files.qemu_args == ()


def test_machine_fingerprint_tracks_the_device_layout() -> None:
    base = machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=1)
    assert base == machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=1)
    others = {
        machine_fingerprint(Accelerator.KVM, memory_mib=256, vcpus=1),
        machine_fingerprint(Accelerator.TCG, memory_mib=512, vcpus=1),
        machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=2),
        machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=1, nic=True, mac="02:00:00:00:00:01"),
        machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=1, nic=True, mac="02:00:00:00:00:02"),
    }
    assert base not in others and len(others) == 5


def test_can_restore_checks_accelerator_layout_and_qemu_version(tmp_path: Path, pool: StoragePool) -> None:
    try:
        version = qemu_version()
    except HostInfoError:
        pytest.skip("no QEMU on this host")
    rt = _runtime(tmp_path, PoolStorage(pool), accel="tcg")
    image = _image(tmp_path, "img")
    spec = VMSpec(image=image)
    nic_spec = VMSpec(image=image, network=SimpleNamespace(mac="02:00:00:00:00:01"))
    layout = machine_fingerprint(Accelerator.TCG, memory_mib=256, vcpus=1)
    assert rt.can_restore(_snapshot(tmp_path, accel="tcg", machine=layout, qemu=version), spec)
    assert rt.can_restore(_snapshot(tmp_path, accel="tcg", machine=None, qemu=None), spec)
    assert not rt.can_restore(_snapshot(tmp_path, accel="tcg", machine=layout, qemu=version), nic_spec)
    assert not rt.can_restore(_snapshot(tmp_path, accel="kvm", machine=None, qemu=version), spec)
    assert not rt.can_restore(_snapshot(tmp_path, accel="warp", machine=None, qemu=version), spec)
    assert not rt.can_restore(_snapshot(tmp_path, accel="tcg", machine=layout, qemu="0.0.1"), spec)

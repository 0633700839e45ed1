"""Snapshot mechanics against a real QEMU microvm (firmware only, no guest kernel: fast, no image needed).

Guest RAM content is observed from the host side: a pattern written into the VM's shared RAM file before
the snapshot must be in guest physical memory (read back with QMP ``pmemsave``) after every kind of
restore, including a restore of a snapshot taken from an already restored VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from qemu.qmp import QMPClient

from capsa.common.image import GuestImage
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import PoolStorage
from capsa.node.runtime.snapshot.manifest import FileEntry, SnapshotManifest, file_sha256, load_manifest
from capsa.node.runtime.snapshot.mechanics import (
    RamMode,
    SnapshotError,
    create_ram_file,
    load_state,
    memory_backend_args,
    plan_restore,
    save_snapshot,
)
from capsa.node.runtime.workdir import VmDir
from capsa.node.storage import StoragePool, StorageSettings

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for the btrfs loop pool"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86_64 missing"),
]

MEM_MIB = 64
PATTERN_OFFSET = 40 * 1024 * 1024  # well above anything qboot touches
MiB = 1024 * 1024


class Vm:
    def __init__(self, proc: asyncio.subprocess.Process, qmp: QMPClient, workdir: Path) -> None:
        self.proc = proc
        self.qmp = qmp
        self.workdir = workdir

    async def read_guest(self, addr: int, size: int) -> bytes:
        out = self.workdir / f"pmem-{addr}-{size}"
        await self.qmp.execute("pmemsave", {"val": addr, "size": size, "filename": str(out)})
        data = out.read_bytes()
        out.unlink()
        return data

    async def status(self) -> str:
        info = await self.qmp.execute("query-status")
        assert isinstance(info, dict)
        return str(info["status"])

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.qmp.execute("quit"), 3)
        with contextlib.suppress(Exception):
            await self.qmp.disconnect()
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


@contextlib.asynccontextmanager
async def launch(workdir: Path, extra: Sequence[str]) -> AsyncIterator[Vm]:
    os.makedirs(workdir, exist_ok=True)
    sock = workdir / "qmp.sock"
    argv = [
        "qemu-system-x86_64",
        "-M", "microvm,x-option-roms=off,isa-serial=off,rtc=on,acpi=on,pit=on,pic=on",
        "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", f"{MEM_MIB}M",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-device", "virtio-serial-device,max_ports=2",
        "-qmp", f"unix:{sock},server=on,wait=off",
        *extra,
    ]
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    qmp = QMPClient("test")
    try:
        for _ in range(500):
            if sock.exists():
                with contextlib.suppress(Exception):
                    await qmp.connect(str(sock))
                    break
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
        if proc.returncode is not None or not sock.exists():
            assert proc.stderr is not None
            raise RuntimeError("qemu did not start: " + (await proc.stderr.read()).decode())
        vm = Vm(proc, qmp, workdir)
        yield vm
    finally:
        if proc.returncode is None:
            await Vm(proc, qmp, workdir).stop()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[StoragePool]:
    p = StoragePool.open(tmp_path / "state", StorageSettings(loop_size_mib=1024, require_cow=True))
    try:
        yield p
    finally:
        p.destroy()


def _qemu_pids_under(path: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


async def _boot_shared(pool: StoragePool, name: str, pattern: bytes) -> tuple[Path, Path]:
    sdir = pool.sandbox_dir(name, create=True)
    ram = sdir / "memory.ram"
    create_ram_file(ram, MEM_MIB)
    disk = sdir / "disk.img"
    disk.write_bytes(b"disk-content" * 1000)
    # What the guest will see in its RAM: the file is mapped shared, so host writes land in guest memory.
    _write_at(ram, PATTERN_OFFSET, pattern)
    return ram, disk


async def _frozen(pool: StoragePool, tmp_path: Path, name: str, pattern: bytes) -> Path:
    """Snapshot ``name`` of a VM whose shared RAM file holds ``pattern`` (the VM stopped after it)."""
    ram, disk = await _boot_shared(pool, "sbx_src", pattern)
    snap = pool.snapshot_dir(name)
    async with launch(tmp_path / "src", memory_backend_args(MEM_MIB, ram, share=True)) as vm:
        await save_snapshot(vm.qmp, snap, disk=disk, ram=ram, clone=pool.clone, memory_mib=MEM_MIB, vcpus=1,
                            accel="tcg", image_digest="sha256:test", resume=False)
    return snap


async def test_save_restore_private_and_copy_and_resave(pool: StoragePool, tmp_path: Path) -> None:
    pattern = os.urandom(4096)
    ram, disk = await _boot_shared(pool, "sbx_src", pattern)
    snap = pool.snapshot_dir("snap_a")
    async with launch(tmp_path / "vm0", memory_backend_args(MEM_MIB, ram, share=True)) as vm:
        assert await vm.read_guest(PATTERN_OFFSET, 4096) == pattern
        assert await vm.status() == "running"
        manifest = await save_snapshot(vm.qmp, snap, disk=disk, ram=ram, clone=pool.clone, memory_mib=MEM_MIB,
                                       vcpus=1, accel="tcg", image_digest="sha256:test", resume=True,
                                       content_digest=True)
        # Rolling snapshot: the VM keeps running afterwards.
        assert await vm.status() == "running"
    assert manifest.ram is not None and manifest.ram.size == MEM_MIB * MiB
    # Only device state travelled through the stream; the RAM is the reflinked file.
    assert manifest.device_state.size < 1 * MiB
    assert load_manifest(snap, verify_content=True) == manifest
    assert manifest.digest.startswith("sha256:")
    assert (snap / "disk.img").read_bytes() == disk.read_bytes()

    # Restore with a private mapping of the frozen RAM file.
    sdir = pool.sandbox_dir("sbx_private", create=True)
    plan = plan_restore(snap, sdir, clone=pool.clone, mode=RamMode.PRIVATE, memory_mib=MEM_MIB)
    assert plan.ram == snap / "memory.ram" and not plan.shared_ram
    async with launch(tmp_path / "vm1", plan.extra_args) as vm:
        assert await vm.status() == "inmigrate"
        await plan.load(vm.qmp)
        assert await vm.status() == "running"
        assert await vm.read_guest(PATTERN_OFFSET, 4096) == pattern
        # A snapshot of a privately mapped VM carries its RAM inside the state stream.
        snap_b = pool.snapshot_dir("snap_b")
        mb = await save_snapshot(vm.qmp, snap_b, disk=plan.disk, ram=None, clone=pool.clone,
                                 memory_mib=MEM_MIB, vcpus=1, accel="tcg", image_digest="sha256:test",
                                 parent=manifest.id, resume=False)
        assert await vm.status() == "postmigrate"
    assert mb.ram is None and mb.parent == "snap_a"
    assert not (snap_b / "memory.ram").exists()
    # The frozen file was never written through the private mapping.
    assert _read_at(snap / "memory.ram", PATTERN_OFFSET, 4096) == pattern

    # Restore that stream snapshot into a shared RAM file, then snapshot it again on the fast path.
    sdir2 = pool.sandbox_dir("sbx_copy", create=True)
    plan2 = plan_restore(snap_b, sdir2, clone=pool.clone, mode=RamMode.COPY)
    assert plan2.shared_ram and plan2.ram == sdir2 / "memory.ram"
    async with launch(tmp_path / "vm2", plan2.extra_args) as vm:
        await plan2.load(vm.qmp)
        assert await vm.read_guest(PATTERN_OFFSET, 4096) == pattern
        snap_c = pool.snapshot_dir("snap_c")
        mc = await save_snapshot(vm.qmp, snap_c, disk=plan2.disk, ram=plan2.ram, clone=pool.clone,
                                 memory_mib=MEM_MIB, vcpus=1, accel="tcg", image_digest="sha256:test",
                                 parent=mb.id, resume=False)
    assert mc.ram is not None and mc.device_state.size < 1 * MiB
    assert _read_at(snap_c / "memory.ram", PATTERN_OFFSET, 4096) == pattern

    # And that one restores in COPY mode too (a reflinked RAM file per sandbox).
    sdir3 = pool.sandbox_dir("sbx_copy2", create=True)
    plan3 = plan_restore(snap_c, sdir3, clone=pool.clone, mode=RamMode.COPY)
    async with launch(tmp_path / "vm3", plan3.extra_args) as vm:
        await plan3.load(vm.qmp)
        assert await vm.read_guest(PATTERN_OFFSET, 4096) == pattern
    assert _qemu_pids_under(tmp_path) == []


async def test_clone_mode_maps_its_own_copy_privately(pool: StoragePool, tmp_path: Path) -> None:
    """CLONE: the sandbox gets its own reflink of the RAM file, mapped privately (no write-back to the pool
    while it runs); a snapshot of it carries the RAM in the stream, like a PRIVATE one."""
    pattern = os.urandom(4096)
    snap = await _frozen(pool, tmp_path, "snap_k", pattern)
    sdir = pool.sandbox_dir("sbx_clone", create=True)
    plan = plan_restore(snap, sdir, clone=pool.clone, mode=RamMode.CLONE, memory_mib=MEM_MIB)
    assert plan.ram == sdir / "memory.ram" and not plan.shared_ram
    backend = plan.extra_args[plan.extra_args.index("-object") + 1]
    assert f"mem-path={sdir / 'memory.ram'}" in backend and "share=off" in backend
    async with launch(tmp_path / "vm", plan.extra_args) as vm:
        await plan.load(vm.qmp)
        assert await vm.read_guest(PATTERN_OFFSET, 4096) == pattern
        again = pool.snapshot_dir("snap_k2")
        manifest = await save_snapshot(vm.qmp, again, disk=plan.disk, ram=None, clone=pool.clone,
                                       memory_mib=MEM_MIB, vcpus=1, accel="tcg", image_digest="sha256:test",
                                       resume=False)
    assert manifest.ram is None and pattern in (again / manifest.device_state.path).read_bytes()
    assert _read_at(snap / "memory.ram", PATTERN_OFFSET, 4096) == pattern
    assert _qemu_pids_under(tmp_path) == []


async def test_branches_share_one_frozen_file_and_diverge(pool: StoragePool, tmp_path: Path) -> None:
    pattern = os.urandom(4096)
    snap = await _frozen(pool, tmp_path, "snap_x", pattern)
    plans = []
    for i in range(3):
        sdir = pool.sandbox_dir(f"sbx_b{i}", create=True)
        plans.append(plan_restore(snap, sdir, clone=pool.clone, mode=RamMode.PRIVATE))
    async with contextlib.AsyncExitStack() as stack:
        vms = [await stack.enter_async_context(launch(tmp_path / f"b{i}", p.extra_args))
               for i, p in enumerate(plans)]
        await asyncio.gather(*(p.load(v.qmp) for v, p in zip(vms, plans, strict=True)))
        for v in vms:
            assert await v.read_guest(PATTERN_OFFSET, 4096) == pattern
        # Each branch's disk is its own reflink: writes stay private.
        plans[0].disk.write_bytes(b"branch0")
        assert plans[1].disk.read_bytes() == (snap / "disk.img").read_bytes()


async def test_bad_inputs_get_clear_errors_and_leave_nothing(pool: StoragePool, tmp_path: Path) -> None:
    pattern = os.urandom(64)
    ram, disk = await _boot_shared(pool, "sbx_src", pattern)
    snap = pool.snapshot_dir("snap_1")
    async with launch(tmp_path / "src", memory_backend_args(MEM_MIB, ram, share=True)) as vm:
        await save_snapshot(vm.qmp, snap, disk=disk, ram=ram, clone=pool.clone, memory_mib=MEM_MIB, vcpus=1,
                            accel="tcg", image_digest="sha256:img", resume=True)
        # Existing destination.
        with pytest.raises(SnapshotError) as exc:
            await save_snapshot(vm.qmp, snap, disk=disk, ram=ram, clone=pool.clone, memory_mib=MEM_MIB,
                                vcpus=1, accel="tcg", image_digest="sha256:img")
        assert exc.value.code == "snapshot_exists"
        # A failure midway (missing disk) removes the partial directory and leaves the VM running.
        with pytest.raises(Exception, match="no such file"):
            await save_snapshot(vm.qmp, pool.snapshot_dir("snap_2"), disk=disk.with_name("nope"), ram=ram,
                                clone=pool.clone, memory_mib=MEM_MIB, vcpus=1, accel="tcg",
                                image_digest="sha256:img")
        assert await vm.status() == "running"
    assert sorted(p.name for p in pool.snapshots_dir.iterdir()) == ["snap_1"]

    sdir = pool.sandbox_dir("sbx_r", create=True)
    with pytest.raises(SnapshotError) as exc:
        plan_restore(snap, sdir, clone=pool.clone, memory_mib=MEM_MIB * 2)
    assert exc.value.code == "snapshot_mismatch"
    with pytest.raises(SnapshotError) as exc:
        plan_restore(snap, sdir, clone=pool.clone, image_digest="sha256:other")
    assert exc.value.code == "snapshot_mismatch"
    with pytest.raises(SnapshotError) as exc:
        plan_restore(pool.snapshot_dir("snap_missing"), sdir, clone=pool.clone)
    assert exc.value.code == "snapshot_not_found"
    assert list(sdir.iterdir()) == []

    # A tampered manifest or truncated file is refused.
    manifest_path = snap / "manifest.json"
    original = manifest_path.read_text()
    manifest_path.write_text(original.replace('"vcpus": 1', '"vcpus": 2'))
    with pytest.raises(SnapshotError) as exc:
        plan_restore(snap, sdir, clone=pool.clone)
    assert exc.value.code == "snapshot_corrupt"
    manifest_path.write_text(original)
    state = (snap / "state.bin").read_bytes()
    flipped = bytearray(state)
    flipped[len(state) // 2] ^= 0xFF
    (snap / "state.bin").write_bytes(bytes(flipped))  # same size, different content
    with pytest.raises(SnapshotError) as exc:
        plan_restore(snap, sdir, clone=pool.clone)
    assert exc.value.code == "snapshot_corrupt" and "sha256" in exc.value.message
    os.truncate(snap / "state.bin", 10)
    with pytest.raises(SnapshotError) as exc:
        plan_restore(snap, sdir, clone=pool.clone)
    assert exc.value.code == "snapshot_corrupt"
    assert list(sdir.iterdir()) == []
    assert _qemu_pids_under(tmp_path) == []


async def test_corrupt_state_stream_fails_the_restore(pool: StoragePool, tmp_path: Path) -> None:
    ram, disk = await _boot_shared(pool, "sbx_src", b"x")
    snap = pool.snapshot_dir("snap_1")
    async with launch(tmp_path / "src", memory_backend_args(MEM_MIB, ram, share=True)) as vm:
        await save_snapshot(vm.qmp, snap, disk=disk, ram=ram, clone=pool.clone, memory_mib=MEM_MIB, vcpus=1,
                            accel="tcg", image_digest="sha256:img", resume=False)
    bad = tmp_path / "bad-state.bin"
    data = bytearray((snap / "state.bin").read_bytes())
    data[40:4000] = os.urandom(len(data[40:4000]))
    bad.write_bytes(bytes(data))
    plan = plan_restore(snap, pool.sandbox_dir("sbx_r", create=True), clone=pool.clone, mode=RamMode.PRIVATE)
    async with launch(tmp_path / "r", plan.extra_args) as vm:
        with pytest.raises(Exception):  # noqa: B017 - QEMU 7.2 exits on a bad stream; either error is fine
            await asyncio.wait_for(load_state(vm.qmp, bad, ram_in_file=True), 30)
    assert _qemu_pids_under(tmp_path) == []


def test_file_sha256_hashes_holes_as_zeros(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(9 * MiB + 123)
        f.seek(5 * MiB + 7)
        f.write(os.urandom(70_000))
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_manifest_digest_covers_every_field() -> None:
    m = SnapshotManifest(id="snap_1", created_at=SnapshotManifest.now(), memory_mib=256, vcpus=1, accel="tcg",
                         image_digest="abc", device_state=FileEntry(path="state.bin", size=10),
                         ram=None, disk=FileEntry(path="disk.img", size=20)).sealed()
    assert m.digest == m.compute_digest()
    for change in ({"memory_mib": 512}, {"parent": "snap_0"}, {"labels": {"a": "b"}},
                   {"disk": FileEntry(path="disk.img", size=21)}):
        assert m.model_copy(update=change).compute_digest() != m.digest
    with pytest.raises(ValueError):
        FileEntry(path="../escape", size=1)


def test_pool_keeps_one_reflinkable_copy_per_recent_image(pool: StoragePool, tmp_path: Path) -> None:
    storage = PoolStorage(pool)
    paths = []
    for i in range(4):
        rootfs = tmp_path / f"rootfs{i}.ext4"
        rootfs.write_bytes(f"image {i}".encode() * 1000)
        digest = hashlib.sha256(bytes([i])).hexdigest()
        image = GuestImage(kernel=rootfs, initrd=rootfs, rootfs=rootfs, digest=digest, kernel_release="x")
        spec = VMSpec(image=image, memory_mib=16)
        first = storage.boot_files(f"sbx_{i}a", spec, VmDir(tmp_path / "vms" / f"{i}a"), None)
        copies = {p: p.stat().st_ino for p in pool.templates_dir.glob("image-*/rootfs.ext4")}
        second = storage.boot_files(f"sbx_{i}b", spec, VmDir(tmp_path / "vms" / f"{i}b"), None)
        # The image copy is reused, not copied again, and sandbox disks are reflinks of it.
        assert {p: p.stat().st_ino for p in pool.templates_dir.glob("image-*/rootfs.ext4")} == copies
        assert first.disk_cow and second.disk_cow
        assert first.disk.read_bytes() == second.disk.read_bytes() == rootfs.read_bytes()
        newest = max(pool.templates_dir.glob("image-*"), key=lambda p: p.stat().st_ctime_ns)
        paths.append((newest, first.disk, rootfs.read_bytes()))
        os.utime(newest, (time.time() + i, time.time() + i))
    remaining = {p.name for p in pool.templates_dir.iterdir()}
    assert remaining == {paths[2][0].name, paths[3][0].name}
    # Disks made from a pruned copy keep their extents.
    for _, disk, content in paths:
        assert disk.read_bytes() == content

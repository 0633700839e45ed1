"""Snapshots with real VMs (QEMU microvm, TCG here): pause/resume, branch, entropy and clock after restore.

One VM is cold-booted for the whole module (~10 s under TCG); everything else comes from snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.agent.snapshots import Snapshots
from capsa.node.runtime.base import LABEL_PRIVATE_RAM, BootError, SandboxState, VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.runtime.snapshot.manifest import Snapshot, write_manifest
from capsa.node.runtime.snapshot.mechanics import LABEL_RAM_DELTA, RamMode, SnapshotError
from capsa.node.storage import StoragePool, StorageSettings
from tests.support.counter import COUNTER_FILE, counter_past, counter_script, goes_on
from tests.support.memfd_attack import assert_qemu_cannot_write, ram_memfd_mapping, ram_memfds

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop btrfs pool, VM uids)"),
    # One event loop for the module: the runtime and its VMs outlive single tests.
    pytest.mark.asyncio(loop_scope="module"),
]

COUNTER = counter_script(0.1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(state_dir: Path, pool: StoragePool) -> AsyncIterator[QemuRuntime]:
    settings = Settings(state_dir=state_dir, cache_dir=Settings().cache_dir)
    rt = QemuRuntime(settings, storage=PoolStorage(pool))
    try:
        yield rt
    finally:
        await rt.close()


@pytest.fixture(scope="module")
def spec(guest_image: GuestImage) -> VMSpec:
    return VMSpec(image=guest_image, memory_mib=256)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parent(runtime: QemuRuntime, spec: VMSpec) -> AsyncIterator[QemuSandbox]:
    sb = await runtime.boot(spec)
    assert isinstance(sb, QemuSandbox)
    try:
        yield sb
    finally:
        await runtime.destroy(sb)


async def _sh(sb: QemuSandbox, cmd: str) -> str:
    res = await sb.guest.exec(["sh", "-c", cmd], timeout=30)
    assert res.exit_code == 0, (cmd, res.stderr)
    return res.stdout.decode()


async def _counter(sb: QemuSandbox) -> int:
    """The guest's counter (0 before its first tick)."""
    return int((await _sh(sb, f"cat {COUNTER_FILE} 2>/dev/null || echo 0")).strip())


def _qemu_pids(under: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(under).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def paused(runtime: QemuRuntime, spec: VMSpec) -> AsyncIterator[tuple[Snapshot, int, int]]:
    """A session-like VM: a file, a background counter, then paused (snapshot + destroy)."""
    sb = await runtime.boot(spec)
    assert isinstance(sb, QemuSandbox)
    try:
        await sb.guest.write_file("/root/note.txt", b"written before the pause\n")
        proc = await sb.guest.start_process(["sh", "-c", COUNTER])
        before = await counter_past(functools.partial(_counter, sb), 3)
        snap = await runtime.snapshot(sb, resume=False)  # a pause: snapshot, then destroy
        await runtime.destroy(sb)
        assert sb.state is SandboxState.DESTROYED
    finally:
        await runtime.destroy(sb)
    try:
        yield snap, before, proc.pid
    finally:
        runtime.delete_snapshot(snap)


async def test_pause_resume_keeps_files_and_the_counter_continues(
    runtime: QemuRuntime, spec: VMSpec, paused: tuple[Snapshot, int, int], state_dir: Path
) -> None:
    snap, before, pid = paused
    # The paused VM is gone: no process and no files of it remain; only the snapshot does.
    assert not any(p.name.startswith("sbx_") for p in (state_dir / "vms").iterdir())
    assert runtime.pool.list_sandboxes() == []
    assert snap.manifest.ram is not None and snap.manifest.device_state.size < 2 * 1024 * 1024
    started = time.monotonic()
    sb = await runtime.restore(snap, spec)
    restore_s = time.monotonic() - started
    try:
        assert sb.state is SandboxState.RUNNING
        assert await sb.guest.read_file("/root/note.txt") == b"written before the pause\n"
        resumed_at = await _counter(sb)
        assert resumed_at >= before
        # The same process keeps counting from where it was, not from 1.
        assert resumed_at < before + 50
        await counter_past(functools.partial(_counter, sb), resumed_at)  # it keeps counting
        assert any(p.pid == pid and p.running for p in await sb.guest.list_processes())
    finally:
        await runtime.destroy(sb)
    assert runtime.pool.list_sandboxes() == []
    print(f"restore to guest answering: {restore_s:.3f}s")


async def test_private_ram_stays_private_through_pause_and_resume(
    runtime: QemuRuntime, spec: VMSpec, paused: tuple[Snapshot, int, int], state_dir: Path
) -> None:
    """A sandbox restored with RamMode.CLONE (a ``ram: private`` template's) maps its RAM privately; its
    snapshot says so (the RAM travels in the stream) and Snapshots.restore keeps the next restore private:
    a pause and resume does not bring back the shared mapping that a busy guest writes back to the pool."""
    snap, _, _ = paused
    first = await runtime.restore(snap, spec, ram_mode=RamMode.CLONE)
    try:
        assert isinstance(first, QemuSandbox) and first.files.private_ram and not first.files.shared_ram
        await _sh(first, "echo kept > /root/private.txt; sync")
        again = await runtime.snapshot(first, resume=False)
    finally:
        await runtime.destroy(first)
    assert again.manifest.labels[LABEL_PRIVATE_RAM] == "private" and again.manifest.ram is None
    snapshots = Snapshots(runtime, lambda _digest: spec.image)
    resumed = await snapshots.restore(again, "sbx_privateresume")
    try:
        assert isinstance(resumed, QemuSandbox) and resumed.files.private_ram
        assert resumed.pid is not None
        argv = (await asyncio.to_thread(Path(f"/proc/{resumed.pid}/cmdline").read_bytes)).split(b"\0")
        backend = next(a for a in argv if a.startswith(b"memory-backend-file"))
        assert b"share=off" in backend and b"sbx_privateresume" in backend
        assert await resumed.guest.read_file("/root/private.txt") == b"kept\n"
    finally:
        await runtime.destroy(resumed)
        runtime.delete_snapshot(again)
    assert runtime.pool.list_sandboxes() == []


async def test_branch_into_three_sees_parent_files_then_diverges(
    runtime: QemuRuntime, spec: VMSpec, parent: QemuSandbox
) -> None:
    await parent.guest.write_file("/root/shared.txt", b"from the parent\n")
    await _sh(parent, "sync")
    snap = await runtime.snapshot(parent, resume=True)  # the parent keeps running
    branches = await runtime.branch(snap, 3, spec)
    try:
        assert len({b.id for b in branches}) == 3
        for i, b in enumerate(branches):
            assert await b.guest.read_file("/root/shared.txt") == b"from the parent\n"
            await b.guest.write_file("/root/mine.txt", f"branch {i}\n".encode())
            await b.guest.write_file("/root/shared.txt", f"changed by branch {i}\n".encode())
        await parent.guest.write_file("/root/parent-after.txt", b"parent only\n")
        for i, b in enumerate(branches):
            assert await b.guest.read_file("/root/mine.txt") == f"branch {i}\n".encode()
            assert await b.guest.read_file("/root/shared.txt") == f"changed by branch {i}\n".encode()
            assert "parent-after.txt" not in (await _sh(b, "ls /root")).split()
        assert await parent.guest.read_file("/root/shared.txt") == b"from the parent\n"
        assert "mine.txt" not in (await _sh(parent, "ls /root")).split()
        # Disks diverge on the host too: each branch has its own reflinked disk file.
        disks = {b.files.disk for b in branches}
        assert len(disks) == 3 and all(d.exists() for d in disks)
    finally:
        for b in branches:
            await runtime.destroy(b)
        runtime.delete_snapshot(snap)


async def test_branches_share_the_snapshots_clean_pages_and_no_qemu_can_write_them(
    runtime: QemuRuntime, spec: VMSpec, parent: QemuSandbox
) -> None:
    await _sh(parent, "head -c 16M /dev/urandom > /dev/shm/shared-data")  # guest RAM both branches keep
    snap = await runtime.snapshot(parent, resume=True)
    branches = await runtime.branch(snap, 2, spec)
    try:
        for b in branches:  # every branch reads the 16 MiB, so its QEMU maps those pages
            await _sh(b, "md5sum /dev/shm/shared-data")
        await _sh(branches[0], "head -c 8M /dev/urandom > /dev/shm/mine; echo one > /dev/shm/who")
        await _sh(branches[1], "echo two > /dev/shm/who")
        assert (await _sh(branches[0], "cat /dev/shm/who")).strip() == "one"
        assert (await _sh(branches[1], "cat /dev/shm/who; ls /dev/shm")).split() == ["two", "shared-data",
                                                                                     "who"]
        pids = [b.pid for b in branches]
        assert all(pids)
        maps = [ram_memfd_mapping(pid) for pid in pids if pid]
        # One memfd (one inode) for both, and its pages are shared, not copies: measured, not assumed.
        assert maps[0][0] == maps[1][0]
        for _, fields in maps:
            # memfd pages are shmem, counted as dirty: shared ones are Shared_*, the guest's own writes
            # Anonymous (copy-on-write).
            assert fields["Shared_Clean"] + fields["Shared_Dirty"] >= 16 * 1024, fields
            assert fields["Pss"] < fields["Rss"] * 0.75, fields
        # Neither the frozen file nor the memfd can be written by the QEMU's uid, even through QEMU's own
        # descriptor.
        ram = snap.path / "memory.ram"
        for b, pid in zip(branches, pids, strict=True):
            assert b.vm_uid is not None and pid
            assert_qemu_cannot_write(pid, b.vm_uid, ram)
    finally:
        for b in branches:
            await runtime.destroy(b)
        runtime.delete_snapshot(snap)
        await _sh(parent, "rm -f /dev/shm/shared-data")
    assert ram_memfds() == {}  # the node closed its copy with the last branch


async def test_a_paused_branch_records_only_what_it_changed_and_resumes_whole(
    runtime: QemuRuntime, spec: VMSpec, parent: QemuSandbox
) -> None:
    await _sh(parent, "head -c 16M /dev/urandom > /dev/shm/from-parent")
    base = await runtime.snapshot(parent, resume=True)
    [branch] = await runtime.branch(base, 1, spec)
    resumed: list[QemuSandbox] = []
    paused: Snapshot | None = None
    try:
        digest = await _sh(branch, "head -c 4M /dev/urandom > /dev/shm/mine; md5sum /dev/shm/*")
        await branch.guest.start_process(["sh", "-c", COUNTER])
        before = await counter_past(functools.partial(_counter, branch), 3)
        paused = await runtime.snapshot(branch, resume=False)
        await runtime.destroy(branch)
        # The snapshot holds its base's RAM file (a reflink) and, in the stream, only the pages that
        # differ from it: far less than the 20 MiB of /dev/shm alone, let alone the guest's whole RAM.
        assert paused.manifest.labels[LABEL_RAM_DELTA] == base.id
        assert paused.manifest.ram is not None
        state = (paused.path / "state.bin").stat().st_size
        assert 4 << 20 < state < 16 << 20, state
        assert (paused.path / "memory.ram").read_bytes() == (base.path / "memory.ram").read_bytes()
        for mode in (RamMode.COPY, RamMode.PRIVATE):
            vm = await runtime.restore(paused, spec, ram_mode=mode)
            assert isinstance(vm, QemuSandbox)
            resumed.append(vm)
            assert await _sh(vm, "md5sum /dev/shm/from-parent /dev/shm/mine") == digest
            await goes_on(functools.partial(_counter, vm), before)  # the process kept its memory
        # A resumed copy snapshots again as any shared-RAM VM does: a RAM file, no delta.
        again = await runtime.snapshot(resumed[0], resume=True)
        assert LABEL_RAM_DELTA not in again.manifest.labels
        runtime.delete_snapshot(again)
    finally:
        for vm in (branch, *resumed):
            await runtime.destroy(vm)
        for snap in (paused, base):
            if snap is not None:
                runtime.delete_snapshot(snap)
        await _sh(parent, "rm -f /dev/shm/from-parent")


async def _random_and_clock(sb: QemuSandbox) -> tuple[str, float]:
    out = await _sh(sb, "python3 -c 'import os,time; print(os.urandom(16).hex(), time.time())'")
    rnd, clock = out.split()
    return rnd, float(clock) - time.time()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def quiet(runtime: QemuRuntime, parent: QemuSandbox) -> AsyncIterator[Snapshot]:
    """A snapshot of an idle VM, old enough (3 s) that a stale guest clock is obvious."""
    snap = await runtime.snapshot(parent, resume=True)
    await asyncio.sleep(3)
    try:
        yield snap
    finally:
        runtime.delete_snapshot(snap)


async def test_restores_get_their_own_entropy_and_the_right_clock(
    runtime: QemuRuntime, spec: VMSpec, quiet: Snapshot
) -> None:
    a = await runtime.restore(quiet, spec)
    b = await runtime.restore(quiet, spec, ram_mode=RamMode.PRIVATE)
    try:
        rnd_a, skew_a = await _random_and_clock(a)
        rnd_b, skew_b = await _random_and_clock(b)
        assert rnd_a != rnd_b
        assert abs(skew_a) < 1.5 and abs(skew_b) < 1.5
    finally:
        await runtime.destroy(a)
        await runtime.destroy(b)


_READER = (
    "import os, time\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    "    with open('/dev/shm/rng.log', 'a') as f:\n"
    "        f.write('RNGLOG%06d %s\\n' % (n, os.urandom(8).hex()))\n"
    "    time.sleep(0.01)\n"
)
_LOG_LINE = re.compile(rb"RNGLOG(\d{6}) ([0-9a-f]{16})\n")


def _last_sample_in(ram: Path) -> int:
    """The newest sample number the guest had written when the snapshot froze its RAM (the log is on a
    tmpfs, so it is in guest memory)."""
    with open(ram, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return max(int(x.group(1)) for x in _LOG_LINE.finditer(m))


async def _samples(sb: QemuSandbox) -> dict[int, bytes]:
    log = await sb.guest.read_file("/dev/shm/rng.log")
    return {int(x.group(1)): x.group(2) for x in _LOG_LINE.finditer(log)}


async def test_clones_share_rng_state_at_resume_and_differ_after_the_reseed(
    runtime: QemuRuntime, spec: VMSpec, quiet: Snapshot
) -> None:
    """Why the reseed exists, and that it is done before a restore returns.

    A guest process samples os.urandom every 10 ms. Two restores of one snapshot of it produce the very
    same first sample after resuming (they share the kernel's CRNG state), and different samples once
    the restore has returned (reseeded with host entropy).
    """
    src = await runtime.restore(quiet, spec)
    try:
        await src.guest.start_process(["python3", "-c", _READER])
        await asyncio.sleep(0.7)
        snap = await runtime.snapshot(src, resume=False)
    finally:
        await runtime.destroy(src)
    try:
        assert snap.manifest.ram is not None
        frozen_at = await asyncio.to_thread(_last_sample_in, snap.path / snap.manifest.ram.path)
        a, b = await asyncio.gather(runtime.restore(snap, spec), runtime.restore(snap, spec))
        try:
            reseeded_a, reseeded_b = max(await _samples(a)), max(await _samples(b))
            await asyncio.sleep(0.5)
            log_a, log_b = await _samples(a), await _samples(b)
        finally:
            await runtime.destroy(a)
            await runtime.destroy(b)
        first = frozen_at + 1
        # Usually equal (one CRNG state at resume), but on this kernel the clones may already have
        # diverged by themselves before the first sample under load: observed, not asserted.
        print(f"first sample after resume equal in both clones: {log_a[first] == log_b[first]}")
        after = [n for n in log_a if n > max(reseeded_a, reseeded_b) and n in log_b]
        assert len(after) >= 5
        assert all(log_a[n] != log_b[n] for n in after)
    finally:
        runtime.delete_snapshot(snap)


async def _reseeds(sb: QemuSandbox) -> int:
    count = (await sb.guest.health())["rng_reseeds"]
    assert isinstance(count, int)
    return count


async def test_every_restore_reseeds_the_guest_crng_before_it_returns(
    runtime: QemuRuntime, spec: VMSpec, quiet: Snapshot
) -> None:
    """The guest daemon counts the reseeds it performed (both ioctls done) in its own memory, which the
    snapshot carries: a restore without the refresh shows the snapshot's count, and every restore with it
    shows one more by the time ``restore`` returns. Removing the reseed from the restore path (or the
    ioctls from the guest) fails this test, unlike sampling urandom, which drifts apart on its own."""
    plain = await runtime.restore(quiet, spec, refresh=False)
    try:
        in_snapshot = await _reseeds(plain)
    finally:
        await runtime.destroy(plain)
    a, b = await asyncio.gather(runtime.restore(quiet, spec), runtime.restore(quiet, spec))
    try:
        assert [await _reseeds(a), await _reseeds(b)] == [in_snapshot + 1, in_snapshot + 1]
    finally:
        await runtime.destroy(a)
        await runtime.destroy(b)


async def test_without_the_refresh_the_guest_clock_lags(
    runtime: QemuRuntime, spec: VMSpec, quiet: Snapshot
) -> None:
    """The control for the test above: the clock push is what makes the clock right.

    (The RNG half cannot be shown the same way: without the reseed the 6.1 guest kernel under TCG still
    drifts apart on its own, 20 ms to 1 s after resuming in our runs (timing-dependent CRNG use and its
    early-boot self reseeds). What the clones do share is shown by the test above; the reseed is what
    guarantees they stop sharing it before anyone uses them.)
    """
    a = await runtime.restore(quiet, spec, refresh=False)
    try:
        _, skew = await _random_and_clock(a)
        age = time.time() - quiet.manifest.created_at.timestamp()
        # The guest clock stood still from the snapshot to the restore (the lower bound leaves room for a
        # slow exec round trip on a loaded host, which also counts as skew here).
        assert -(age + 10) < skew < -2, f"guest clock skew {skew:.2f}s, snapshot age {age:.2f}s"
    finally:
        await runtime.destroy(a)


async def test_rolling_snapshot_leaves_the_vm_running_and_is_a_point_in_time(
    runtime: QemuRuntime, spec: VMSpec, parent: QemuSandbox
) -> None:
    await parent.guest.write_file("/root/before.txt", b"1")
    snap = await runtime.snapshot(parent, resume=True)
    assert parent.state is SandboxState.RUNNING
    await parent.guest.write_file("/root/after.txt", b"2")
    restored = await runtime.restore(snap, spec)
    try:
        listing = (await _sh(restored, "ls /root")).split()
        assert "before.txt" in listing and "after.txt" not in listing
        # A restored VM can itself be snapshotted again (its RAM is a shared reflinked copy).
        snap2 = await runtime.snapshot(restored, resume=True)
        assert snap2.manifest.parent == snap.id and snap2.manifest.ram is not None
        runtime.delete_snapshot(snap2)
    finally:
        await runtime.destroy(restored)
        runtime.delete_snapshot(snap)


async def test_bad_requests_get_clear_errors_and_change_nothing(
    runtime: QemuRuntime, spec: VMSpec, paused: tuple[Snapshot, int, int], state_dir: Path
) -> None:
    snap, _, _ = paused
    before_pool = runtime.pool.list_sandboxes()
    before_vms = sorted(p.name for p in (state_dir / "vms").iterdir())
    for n in (0, 10_000, -1):
        with pytest.raises(SnapshotError) as info:
            await runtime.branch(snap, n, spec)
        assert info.value.code == "invalid_branch_count" and info.value.status == 422
    with pytest.raises(SnapshotError) as info:
        await runtime.restore("snap_doesnotexist0000000", spec)
    assert info.value.code == "snapshot_not_found"
    with pytest.raises(SnapshotError) as info:
        await runtime.restore(snap, VMSpec(image=spec.image, memory_mib=512))
    assert info.value.code == "snapshot_mismatch"
    with pytest.raises(BootError, match="invalid sandbox id"):
        await runtime.restore(snap, spec, sandbox_id="../escape")
    with pytest.raises(BootError, match="must describe a tap"):
        await runtime.restore(snap, VMSpec(image=spec.image, network=object()))
    # A NIC is part of the device layout: a snapshot taken without one does not restore with one.
    nic = SimpleNamespace(netns="nope", tap="nope", mac="02:ca:00:00:00:01", guest_ip="10.0.0.2",
                          gateway_ip="10.0.0.1", prefixlen=30)
    with pytest.raises(SnapshotError) as info:
        await runtime.restore(snap, VMSpec(image=spec.image, memory_mib=spec.memory_mib, vcpus=spec.vcpus,
                                           network=nic))
    assert info.value.code == "snapshot_mismatch"
    # A snapshot from another VM layout (e.g. QEMU options changed since) is refused before QEMU starts.
    assert snap.manifest.machine is not None
    original = (snap.path / "manifest.json").read_text()
    write_manifest(snap.path, snap.manifest.model_copy(update={"machine": "sha256:" + "0" * 64}))
    try:
        with pytest.raises(SnapshotError, match="different VM layout") as info:
            await runtime.restore(snap.path, spec)
        assert info.value.code == "snapshot_mismatch"
    finally:
        (snap.path / "manifest.json").write_text(original)
    assert runtime.pool.list_sandboxes() == before_pool
    assert sorted(p.name for p in (state_dir / "vms").iterdir()) == before_vms
    assert len(runtime.list()) == len(before_pool)


async def test_closing_leaves_no_process_or_file(runtime: QemuRuntime, spec: VMSpec,
                                                 paused: tuple[Snapshot, int, int], state_dir: Path) -> None:
    snap, _, _ = paused
    sbs = await runtime.branch(snap, 2, spec)
    ids = [s.id for s in sbs]
    for s in sbs:
        await runtime.destroy(s)
    for sid in ids:
        assert not (state_dir / "vms" / sid).exists()
        assert not runtime.pool.sandbox_dir(sid).exists()
    live = {s.pid for s in runtime.list()}
    assert [p for p in _qemu_pids(state_dir) if p not in live] == []


async def test_a_killed_vm_comes_back_from_its_latest_rolling_snapshot(
    runtime: QemuRuntime, spec: VMSpec, quiet: Snapshot
) -> None:
    sb = await runtime.restore(quiet, spec)
    try:
        await sb.guest.write_file("/root/progress.txt", b"step 1\n")
        first = await runtime.snapshot(sb, resume=True)
        await sb.guest.write_file("/root/progress.txt", b"step 2\n")
        latest = await runtime.snapshot(sb, resume=True)
        await sb.guest.write_file("/root/progress.txt", b"step 3, never snapshotted\n")
        assert sb.pid is not None
        os.kill(sb.pid, 9)
        for _ in range(200):
            if sb.state is SandboxState.FAILED:
                break
            await asyncio.sleep(0.05)
        assert sb.state is SandboxState.FAILED and sb.failure and "signal 9" in sb.failure
    finally:
        await runtime.destroy(sb)
    back = await runtime.restore(latest, spec)
    try:
        assert await back.guest.read_file("/root/progress.txt") == b"step 2\n"
        assert first.manifest.parent == quiet.id and latest.manifest.parent == first.id
    finally:
        await runtime.destroy(back)
        runtime.delete_snapshot(first)
        runtime.delete_snapshot(latest)


async def test_pool_without_cow_still_snapshots_with_plain_copies(state_dir: Path, spec: VMSpec) -> None:
    plain = state_dir / "plain-pool"  # on the host's ext4: no reflinks
    plain.mkdir(mode=0o711)
    state = state_dir / "plain-state"
    state.mkdir(mode=0o711)
    pool = StoragePool.open(state, StorageSettings(path=plain))
    assert pool.cow is False and pool.warning is not None
    rt = QemuRuntime(Settings(state_dir=state, cache_dir=Settings().cache_dir),
                     storage=PoolStorage(pool))
    try:
        sb = await rt.boot(spec)
        try:
            assert sb.files.disk_cow is False
            await sb.guest.write_file("/root/plain.txt", b"no cow\n")
            snap = await rt.snapshot(sb, resume=False)
        finally:
            await rt.destroy(sb)
        back = await rt.restore(snap, spec)
        try:
            assert await back.guest.read_file("/root/plain.txt") == b"no cow\n"
        finally:
            await rt.destroy(back)
        # The copies are sparse: the snapshot's disk does not take the image's full apparent size.
        disk = snap.path / snap.manifest.disk.path
        assert disk.stat().st_blocks * 512 < disk.stat().st_size
        rt.delete_snapshot(snap)
    finally:
        await rt.close()
    assert rt.pool.list_sandboxes() == [] and rt.pool.list_snapshots() == []

"""VM uids and branch RAM groups are allocated, not merely picked at random (issue 9, finding 16), and
QEMU's command starts with the isolation it runs under (finding 4)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from capsa.common.ids import new_id
from capsa.node.runtime.ids import IdAllocator, IdsExhausted
from capsa.node.runtime.qemu.process import isolation_prefix
from capsa.node.runtime.qemu.storage import RAM_GID_BASE, RAM_GID_COUNT, PoolStorage
from capsa.node.runtime.snapshot.manifest import RAM_FILE, FileEntry, Snapshot, SnapshotManifest
from capsa.node.runtime.workdir import VM_UID_BASE, vm_uids_in_use
from capsa.node.storage.pool import StoragePool, StorageSettings

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other ids needs root")


def test_a_small_range_hands_out_every_id_once_then_refuses() -> None:
    ids = IdAllocator(100, 8, "test id")
    got = [ids.allocate() for _ in range(8)]
    assert sorted(got) == list(range(100, 108))
    with pytest.raises(IdsExhausted):
        ids.allocate()
    ids.release(103)
    assert ids.allocate() == 103
    ids.release(999)  # not ours: a no-op


def test_ids_taken_on_disk_are_skipped_and_claimed_ids_are_live() -> None:
    ids = IdAllocator(0, 4, "test id")
    assert ids.allocate(taken={0, 1, 2}) == 3
    ids.claim(0)
    assert ids.live == {0, 3}
    assert ids.allocate(taken={99}) in {1, 2}
    with pytest.raises(ValueError):
        ids.claim(4)


def test_concurrent_allocations_never_share_an_id() -> None:
    # 64 threads x 30 ids from a range of 2000: random picks would collide often (birthday bound).
    ids = IdAllocator(VM_UID_BASE, 2000, "VM uid")
    got: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [ids.allocate() for _ in range(30)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 1920


def test_vm_uids_in_use_reads_the_run_dirs(tmp_path: Path) -> None:
    for name, uid in (("a", 1_879_048_300), ("b", 1_879_048_301)):
        (tmp_path / name / "run").mkdir(parents=True)
        if os.geteuid() == 0:
            os.chown(tmp_path / name / "run", uid, uid)
    expected = {1_879_048_300, 1_879_048_301} if os.geteuid() == 0 else {os.geteuid()}
    assert vm_uids_in_use(tmp_path) == expected


def _snapshot_with_ram(pool: StoragePool) -> Snapshot:
    sid = new_id("snap")
    path = pool.snapshot_dir(sid)
    path.mkdir(mode=0o700)
    (path / RAM_FILE).write_bytes(b"\0" * 4096)
    (path / RAM_FILE).chmod(0o600)
    entry = FileEntry(path="state.bin", size=1)
    manifest = SnapshotManifest(id=sid, created_at=SnapshotManifest.now(), memory_mib=16, vcpus=1,
                                accel="tcg", image_digest="d", device_state=entry,
                                ram=FileEntry(path=RAM_FILE, size=4096),
                                disk=FileEntry(path="disk.img", size=1))
    return Snapshot(path, manifest.sealed())


@root_only
def test_branch_sets_get_their_own_ram_group_released_with_the_last_branch(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    root.mkdir()
    storage = PoolStorage(StoragePool.open(tmp_path / "state", StorageSettings(path=root)))
    one, two = _snapshot_with_ram(storage.pool), _snapshot_with_ram(storage.pool)
    # Two branches of one snapshot share its group; another snapshot's branches get a different one.
    g1 = storage._grant_private_ram(one, "sbx_a")
    assert storage._grant_private_ram(one, "sbx_b") == g1
    g2 = storage._grant_private_ram(two, "sbx_c")
    assert g1 != g2
    for gid in (*g1, *g2):
        assert RAM_GID_BASE <= gid < RAM_GID_BASE + RAM_GID_COUNT < VM_UID_BASE + 1
    st = (one.path / RAM_FILE).stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (0, g1[0], "0o660")
    assert set(g1 + g2) == storage.ram_gids.live
    # The first branch's destroy keeps the group (its sibling still maps the file); the last revokes it.
    storage.release("sbx_a")
    assert (one.path / RAM_FILE).stat().st_gid == g1[0]
    storage.release("sbx_b")
    st = (one.path / RAM_FILE).stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (0, 0, "0o600")
    assert storage.ram_gids.live == set(g2)
    # The next branch set of the first snapshot gets a group no live set holds.
    g3 = storage._grant_private_ram(one, "sbx_d")
    assert g3 != g2


@root_only
def test_a_group_left_on_disk_by_a_previous_node_is_never_handed_to_another_snapshot(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    root.mkdir()
    pool = StoragePool.open(tmp_path / "state", StorageSettings(path=root))
    old = _snapshot_with_ram(pool)
    os.chown(old.path / RAM_FILE, 0, RAM_GID_BASE)
    storage = PoolStorage(pool)
    storage.ram_gids = IdAllocator(RAM_GID_BASE, 2, "branch RAM group")  # room for exactly two
    new = _snapshot_with_ram(pool)
    assert storage._grant_private_ram(new, "sbx_n") == (RAM_GID_BASE + 1,)
    assert storage._grant_private_ram(old, "sbx_o") == (RAM_GID_BASE,)  # its own group, claimed again


def test_qemu_starts_in_a_network_namespace_of_its_own_as_its_vm_user() -> None:
    if os.geteuid() != 0:
        with pytest.raises(Exception, match="only root"):
            isolation_prefix((VM_UID_BASE, VM_UID_BASE))
        return
    prefix = isolation_prefix((VM_UID_BASE + 5, VM_UID_BASE + 5), (36,))
    unshare = next(i for i, p in enumerate(prefix) if p.endswith("unshare"))
    setpriv = next(i for i, p in enumerate(prefix) if p.endswith("setpriv"))
    # unshare (needs root) comes before the drop to the VM user.
    assert prefix[unshare + 1] == "--net" and unshare < setpriv
    assert f"--reuid={VM_UID_BASE + 5}" in prefix and f"--regid={VM_UID_BASE + 5}" in prefix
    assert "--groups=36" in prefix and "--no-new-privs" in prefix and prefix[-1] == "--"
    assert "--clear-groups" in isolation_prefix((VM_UID_BASE, VM_UID_BASE))
    assert isolation_prefix(None)[1:] == ["--net", "--"]

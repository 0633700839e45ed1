"""VM uids are allocated, not merely picked at random (issue 9, finding 16), and
QEMU's command starts with the isolation it runs under (finding 4)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from capsa.node.runtime.ids import IdAllocator, IdsExhausted
from capsa.node.runtime.qemu.process import isolation_prefix
from capsa.node.runtime.workdir import VM_UID_BASE, vm_uids_in_use

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


def test_ids_taken_on_disk_are_skipped() -> None:
    ids = IdAllocator(0, 4, "test id")
    assert ids.allocate(taken={0, 1, 2}) == 3
    assert ids.live == {3}
    assert ids.allocate(taken={0, 99}) in {1, 2}


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

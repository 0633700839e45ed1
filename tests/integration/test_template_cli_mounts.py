"""``capsa template`` mounts the node's storage pool when no node has it mounted, and unmounts it again
when the command ends: a one-off command leaves no loop mount or loop device behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from capsa.node.storage.pool import StoragePool
from tests.support.leftovers import loop_devices_under, mounts_under
from tests.support.served import CAPSA

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop btrfs pool)"),
]


def _ls(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CAPSA, "template", "ls", "--json", "--state-dir", str(state_dir)],
                          capture_output=True, text=True, timeout=300)


def test_template_command_leaves_no_mount(fresh_state_dir: Path) -> None:
    done = _ls(fresh_state_dir)
    assert done.returncode == 0, done.stderr
    assert (fresh_state_dir / "storage" / "pool.btrfs").exists()  # it did mount (and create) the pool
    assert mounts_under(fresh_state_dir) == [] and loop_devices_under(fresh_state_dir) == []


def test_template_command_keeps_a_node_mount(fresh_state_dir: Path) -> None:
    pool = StoragePool.open(fresh_state_dir)  # what a running node holds
    try:
        assert pool.mounted_here
        done = _ls(fresh_state_dir)
        assert done.returncode == 0, done.stderr
        assert mounts_under(fresh_state_dir) != []
    finally:
        pool.destroy()
    assert mounts_under(fresh_state_dir) == []

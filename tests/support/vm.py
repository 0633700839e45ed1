"""Directories and storage for tests that boot real microVMs (the fixtures built on them: ``state_dir``,
``fresh_state_dir`` and ``runtime`` in tests/conftest.py, ``pool`` in tests/integration/conftest.py).

QEMU runs as its own unprivileged uid, so every parent of a state directory must be searchable by others
(pytest's tmp_path and ``mkdtemp`` are 0700), and its Unix socket paths must fit in 107 bytes: state
directories are short paths under /tmp or /var/tmp, mode 0711.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from capsa.node.storage import StoragePool, StorageSettings

__all__ = ["SNAPSHOT_POOL_MIB", "searchable_dir", "snapshot_pool"]

SNAPSHOT_POOL_MIB = 8192  # the loop btrfs image is sparse: it costs what the templates and snapshots use


@contextmanager
def searchable_dir(prefix: str, parent: str = "/tmp", mode: int = 0o711) -> Iterator[Path]:
    """A new directory ``<parent>/<prefix>XXXXXXXX`` with ``mode``, removed with its contents afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def snapshot_pool(state_dir: Path, loop_size_mib: int = SNAPSHOT_POOL_MIB) -> Iterator[StoragePool]:
    """The node's storage pool on a loop-mounted btrfs image under ``state_dir`` (needs root); unmounted
    and deleted afterwards."""
    pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=loop_size_mib, require_cow=True))
    try:
        yield pool
    finally:
        pool.destroy()

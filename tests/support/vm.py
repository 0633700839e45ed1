"""Directories, storage and a node agent for tests that boot real microVMs (the fixtures built on them:
``state_dir``, ``fresh_state_dir`` and ``runtime`` in tests/conftest.py, ``pool`` in
tests/integration/conftest.py).

QEMU runs as its own unprivileged uid, so every parent of a state directory must be searchable by others
(pytest's tmp_path and ``mkdtemp`` are 0700), and its Unix socket paths must fit in 107 bytes: state
directories are short paths under /tmp or /var/tmp, mode 0711.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.agent.agent import NodeAgent
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.source import TemplateSource

__all__ = ["SNAPSHOT_POOL_MIB", "searchable_dir", "snapshot_pool", "template_node"]

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


@asynccontextmanager
async def template_node(state_dir: Path, pool: StoragePool, image: GuestImage,
                        **source_options: Any) -> AsyncIterator[NodeAgent]:
    """A started node agent whose sandboxes are QEMU VMs on ``pool``, restored from templates
    (``source_options``: :class:`TemplateSource`'s, e.g. ``pool_size``); ready (``base`` in place) when
    it is yielded, closed afterwards."""
    runtime = QemuRuntime(Settings(state_dir=state_dir, cache_dir=Settings().cache_dir),
                          storage=PoolStorage(pool))
    agent = NodeAgent(runtime, image, source=TemplateSource(runtime, image, **source_options))
    await agent.start()
    try:
        await agent.wait_ready()
        yield agent
    finally:
        await agent.close()

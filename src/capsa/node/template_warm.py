"""Filling the template cache without a node: ``capsa image build`` builds ``base`` once (a cold boot and a
snapshot in a throwaway storage pool) and publishes it beside the image, so every node started afterwards
(``capsa serve``, ``capsa node``, CI) restores its first sandbox from it at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage.pool import StoragePool, StorageSettings
from capsa.node.template_cache import TemplateCache
from capsa.node.templates import BASE, TemplateStore

__all__ = ["warm_template_cache"]


async def warm_template_cache(settings: Settings, image: GuestImage, *, memory_mib: int = 256, vcpus: int = 1,
                              force: bool = False, progress: Callable[[str], None] | None = None
                              ) -> tuple[Path, bool]:
    """The cache entry of ``base`` for ``image`` at this size, built unless one this host's QEMU can restore
    is there (``force``: build anyway). Returns (entry, built). Needs root (VMs run as their own uids)."""
    say = progress or (lambda _m: None)
    cache = TemplateCache(settings.cache_dir)
    # A scratch node: its own state dir (searchable by the VM uids) and a btrfs loop pool, removed after.
    state_dir = Path(tempfile.mkdtemp(prefix="capsa-tplcache-", dir="/var/tmp"))
    os.chmod(state_dir, 0o711)
    try:
        pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=8 * 1024))
        try:
            runtime = QemuRuntime(Settings(state_dir=state_dir, cache_dir=settings.cache_dir,
                                           accel=settings.accel),
                                  accel=settings.accel, storage=PoolStorage(pool))
            try:
                store = TemplateStore(runtime, image, cache=cache)
                found = store.cached(BASE, memory_mib, vcpus)
                if found and not force:
                    return found[0], False
                say(f"building template base ({memory_mib} MiB, {vcpus} vCPU): cold boot")
                template = await store.build_base(memory_mib, vcpus, progress=say)
                say("copying it into the template cache")
                entry = cache.publish(BASE, template.path, template.snapshot.manifest)
                return entry, True
            finally:
                await runtime.close()
        finally:
            pool.destroy()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)

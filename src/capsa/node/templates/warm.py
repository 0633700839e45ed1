"""Filling the template cache without a node: ``capsa image build`` builds ``base`` once and ``capsa template
warm NAME...`` builds any node-built template (``base``, ``base-net``, the shipped ``browser`` and
``desktop``), each only when the cache holds no entry this host's QEMU can restore. Builds run in a scratch
node (its own state dir and btrfs loop pool, removed after) through the same code a node uses on first use,
and are published beside the image, so every node started afterwards (``capsa serve``, ``capsa node``, CI)
imports them instead of building them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from capsa.common.errors import CapsaError
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage.pool import StoragePool, StorageSettings
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.shipped import shipped_names, shipped_template
from capsa.node.templates.source import NET_TEMPLATE, TemplateSource, cache_key
from capsa.node.templates.store import BASE
from capsa.store import store_from_settings

__all__ = ["WarmResult", "warm_template_cache", "warm_templates", "warmable_names"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WarmResult:
    name: str
    entry: Path
    built: bool
    seconds: float


def warmable_names() -> list[str]:
    """Every template ``capsa template warm`` can build: the node's own and the shipped ones."""
    return [BASE, NET_TEMPLATE, *shipped_names()]


@contextlib.asynccontextmanager
async def _scratch_node(settings: Settings, image: GuestImage, *, network: bool,
                        memory_mib: int, vcpus: int) -> AsyncIterator[TemplateSource]:
    """A throwaway node: a state dir searchable by the VM uids, a btrfs loop pool, egress when a template
    needs a network for its build; all removed afterwards."""
    from capsa.node.egress.node_egress import NodeEgress

    state_dir = Path(tempfile.mkdtemp(prefix="capsa-tplcache-", dir="/var/tmp"))
    os.chmod(state_dir, 0o711)
    try:
        pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=64 * 1024))
        try:
            runtime = QemuRuntime(Settings(state_dir=state_dir, cache_dir=settings.cache_dir,
                                           accel=settings.accel),
                                  accel=settings.accel, storage=PoolStorage(pool))
            egress = NodeEgress.create(netns_prefix="capsa-tw-") if network else None
            try:
                yield TemplateSource(runtime, image, egress=egress, pool_size=0, base_memory_mib=memory_mib,
                                     base_vcpus=vcpus,
                                     cache=TemplateCache(settings.cache_dir, store_from_settings(settings)))
            finally:
                if egress is not None:
                    await egress.close()
                await runtime.close()
        finally:
            pool.destroy()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _prefixed(say: Progress, name: str) -> Progress:
    return lambda msg: say(f"{name}: {msg}")


async def warm_templates(settings: Settings, image: GuestImage, names: list[str], *, memory_mib: int = 256,
                         vcpus: int = 1, force: bool = False, progress: Progress | None = None,
                         ) -> list[WarmResult]:
    """The cache entries of ``names`` for ``image`` (``base`` and ``base-net`` at ``memory_mib``/``vcpus``,
    shipped templates at their spec's size), each built and published unless the cache already holds one
    this host's QEMU can restore (``force``: build anyway). Needs root (VMs run as their own uids)."""
    say = progress or (lambda _m: None)
    unknown = [n for n in names if n not in warmable_names()]
    if unknown:
        raise CapsaError(f"no such template to warm: {', '.join(unknown)} (known: "
                         f"{', '.join(warmable_names())})", code="template_not_found", status=404)
    network = any(n == NET_TEMPLATE or ((t := shipped_template(n)) is not None and t.spec.network)
                  for n in names)
    results: list[WarmResult] = []
    async with _scratch_node(settings, image, network=network, memory_mib=memory_mib,
                             vcpus=vcpus) as source:
        store = source.store
        for name in names:
            started = time.monotonic()
            key = cache_key(store, name)
            mib, cpus = key.memory_mib, key.vcpus
            found = await asyncio.to_thread(store.cached, key.name, mib, cpus, key.mac)
            if found and not force:
                say(f"{name}: cached ({found[0].name})")
                results.append(WarmResult(name, found[0], False, time.monotonic() - started))
                continue
            say(f"{name}: building ({mib} MiB, {cpus} vCPU)")
            step = _prefixed(say, name)
            if name == BASE:
                template = await store.build_base(mib, cpus, progress=step)
            elif name == NET_TEMPLATE:
                template = await source.build_net_template(mib, cpus)
            else:
                template = await source.build_shipped(name, progress=step)
            say(f"{name}: copying it into the template cache")
            assert store.cache is not None
            entry = await asyncio.to_thread(store.cache.publish, key.name, template.path,
                                            template.snapshot.manifest)
            say(f"{name}: built in {time.monotonic() - started:.0f} s, cached as {entry.name}")
            results.append(WarmResult(name, entry, True, time.monotonic() - started))
    return results


async def warm_template_cache(settings: Settings, image: GuestImage, *, memory_mib: int = 256, vcpus: int = 1,
                              force: bool = False, progress: Callable[[str], None] | None = None
                              ) -> tuple[Path, bool]:
    """The cache entry of ``base`` for ``image`` at this size (``capsa image build``). Returns (entry,
    built)."""
    (result,) = await warm_templates(settings, image, [BASE], memory_mib=memory_mib, vcpus=vcpus, force=force,
                                     progress=progress)
    return result.entry, result.built

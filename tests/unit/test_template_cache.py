"""The template cache beside the guest image: a node builds ``base`` once, a fresh node imports it instead of
cold-booting; keys, refusals, modes and the node's readiness. Runs the real TemplateStore and NodeService
on the fake runtime (snapshots need root: the fake confines its guests)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from capsa.common.node_wire import HeartbeatOut, NodeHeartbeat, NodeRegister
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.assembly import NodeParts
from capsa.node.daemon import NodeService
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.snapshot.manifest import DISK_FILE, RAM_FILE, SnapshotManifest
from capsa.node.storage.pool import StoragePool, StorageSettings
from capsa.node.templates.cache import TemplateCache, entry_name
from capsa.node.templates.source import TemplateSource
from capsa.node.templates.store import BASE, TemplateStore
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="the fake runtime snapshots confined guests (root)")]


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """Relative path -> (mode bits, uid) of everything under ``root``."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        out[str(path.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_uid)
    return out


async def _store(tmp_path: Path, cache: TemplateCache | None) -> tuple[FakeRuntime, TemplateStore]:
    runtime = FakeRuntime()  # its own templates dir: a node on an empty state directory
    image = fake_image(tmp_path / "image")
    return runtime, TemplateStore(runtime, image, cache=cache)


async def test_a_fresh_node_imports_base_from_the_cache_instead_of_booting(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "cache")
    first, store = await _store(tmp_path, cache)
    built = await store.ensure_base(256, 1)
    await store.wait_published()
    assert first.boots == 1 and store.imports == 0 and store.origins[(BASE, 256, 1)] == "built"
    [entry] = cache.candidates(BASE, store.image.digest, 256, 1)
    assert entry.name == entry_name(BASE, built.snapshot.manifest)
    # The cache is root's and private: 0700 directories, 0600 files.
    for rel, (mode, uid) in _modes(entry).items():
        assert uid == os.geteuid(), rel
        assert mode == (0o700 if (entry / rel).is_dir() else 0o600), (rel, oct(mode))
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700

    second, fresh = await _store(tmp_path, cache)
    template = await fresh.ensure_base(256, 1)
    assert second.boots == 0 and fresh.imports == 1 and fresh.origins[(BASE, 256, 1)] == "cache"
    assert template.digest == built.digest and template.snapshot.id == built.snapshot.id
    assert template.path.parent == second.templates_dir
    # In the pool: the node's modes (root 0600 files in 0711 directories), as a built template has.
    for rel, (mode, uid) in _modes(template.path).items():
        assert uid == os.geteuid(), rel
        assert mode == (0o711 if (template.path / rel).is_dir() else 0o600), (rel, oct(mode))
    assert _modes(template.path).keys() == _modes(built.path).keys()
    # It restores, and the next ensure finds it on the pool (no second import).
    spec = VMSpec(image=fresh.image, memory_mib=256, vcpus=1)
    sandbox = await second.restore(template.snapshot, spec)
    assert (await sandbox.guest.exec(["true"])).exit_code == 0
    await second.destroy(sandbox)
    assert (await fresh.ensure_base(256, 1)).path == template.path and fresh.imports == 1
    # Another size is another key: built, then cached beside the first.
    await fresh.ensure_base(512, 1)
    await fresh.wait_published()
    assert second.boots == 1 and len(list(cache.root.glob("base-*"))) == 2


async def test_an_import_writes_copied_files_back_before_it_returns(tmp_path: Path, monkeypatch: Any) -> None:
    # btrfs writes a file's dirty pages back before reflinking it: the first restore must not pay that.
    import capsa.node.templates.cache as template_cache
    from capsa.node.storage import filecopy

    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    await store.ensure_base(256, 1)
    await store.wait_published()
    [entry] = cache.candidates(BASE, store.image.digest, 256, 1)
    written: list[str] = []

    def write_back(path: Path) -> None:
        filecopy.write_back(path)  # the real one, on a real file
        written.append(path.name)

    monkeypatch.setattr(template_cache, "write_back", write_back)
    monkeypatch.setattr(template_cache, "copy_file", lambda *a, **kw: filecopy.copy_file(*a, cow=False, **kw))
    cache.import_into(entry, tmp_path / "imported")
    copied = sorted(p.name for p in (tmp_path / "imported").rglob("*") if p.is_file())
    assert copied and sorted(written) == copied
    # A reflinked file shares its source's extents, already on disk: nothing to write back.
    written.clear()
    monkeypatch.setattr(template_cache, "copy_file", lambda *a, **kw: True)
    cache.import_into(entry, tmp_path / "linked")
    assert written == []
    with pytest.raises(FileNotFoundError):
        filecopy.write_back(tmp_path / "missing")


async def test_entries_this_node_cannot_restore_are_not_imported(tmp_path: Path, monkeypatch: Any) -> None:
    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    built = await store.ensure_base(256, 1)
    await store.wait_published()
    # Another QEMU or device layout: the runtime refuses the cached snapshot, so the node builds its own.
    second, fresh = await _store(tmp_path, cache)
    cached_root = cache.root.resolve()
    real = second.can_restore
    monkeypatch.setattr(second, "can_restore", lambda snap, spec: not snap.path.resolve().is_relative_to(
        cached_root) and real(snap, spec))
    await fresh.ensure_base(256, 1)
    assert second.boots == 1 and fresh.imports == 0
    # Another image or size: a different key altogether.
    assert cache.candidates(BASE, "sha256:other", 256, 1) == []
    assert cache.candidates(BASE, built.image_digest, 256, 2) == []
    assert cache.candidates(BASE, built.image_digest, 256, 1)


@pytest.mark.parametrize("damage", ["truncate", "symlink", "manifest"])
async def test_a_damaged_entry_falls_back_to_a_build(tmp_path: Path, damage: str) -> None:
    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    built = await store.ensure_base(256, 1)
    await store.wait_published()
    [entry] = cache.candidates(BASE, store.image.digest, 256, 1)
    snap = entry / built.snapshot.id
    secret = tmp_path / "host-secret"
    secret.write_text("host bytes")
    if damage == "truncate":
        os.truncate(snap / DISK_FILE, 1)
    elif damage == "symlink":
        (entry / "extra").symlink_to(secret)
    else:
        (snap / "manifest.json").write_text("{}")
    second, fresh = await _store(tmp_path, cache)
    template = await fresh.ensure_base(256, 1)
    assert second.boots == 1 and fresh.imports == 0
    assert not any(p.name == "extra" for p in template.path.rglob("*"))
    assert not list(second.templates_dir.glob(".build-*"))  # no half-imported work dir left
    await fresh.wait_published()  # the fresh build replaces the damaged entry
    [again] = cache.candidates(BASE, store.image.digest, 256, 1)
    assert not (again / "extra").exists()


async def test_closing_the_store_lets_the_cache_copy_finish(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    await store.ensure_base(256, 1)
    await store.close()  # right after the build: the copy is still running, and completes
    assert len(cache.candidates(BASE, store.image.digest, 256, 1)) == 1
    _, fresh = await _store(tmp_path, cache)
    await fresh.ensure_base(256, 1)
    assert fresh.imports == 1


async def test_publish_is_atomic_and_sweeps_debris(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    built = await store.ensure_base(256, 1)
    await store.wait_published()
    debris = cache.root / ".tmp-deadbeef"
    debris.mkdir()
    (debris / RAM_FILE).write_bytes(b"x")
    manifest: SnapshotManifest = built.snapshot.manifest
    entry = await asyncio.to_thread(cache.publish, BASE, built.path, manifest)
    assert not debris.exists() and sorted(p.name for p in cache.root.iterdir()) == [".lock", entry.name]
    # A publish that fails midway (its source vanished) leaves the old entry and no work dir.
    with pytest.raises(OSError):
        await asyncio.to_thread(cache.publish, BASE, tmp_path / "missing", manifest)
    assert sorted(p.name for p in cache.root.iterdir()) == [".lock", entry.name]


async def test_publish_keeps_the_two_newest_entries_per_template_and_size(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "cache")
    _, store = await _store(tmp_path, cache)
    built = await store.ensure_base(256, 1)
    await store.wait_published()
    manifest: SnapshotManifest = built.snapshot.manifest
    (first,) = [p for p in cache.root.iterdir() if p.name != ".lock"]
    os.utime(first, (1, 1))
    # Entries of three QEMU versions (older first), another size and another template: publishing the
    # newest leaves the two newest base 256 MiB entries, and the others untouched.
    entries = []
    for i, version in enumerate(["7.0", "7.1", "7.2"]):
        m = manifest.model_copy(update={"qemu_version": version})
        entry = await asyncio.to_thread(cache.publish, BASE, built.path, m)
        os.utime(entry, (1000 + i, 1000 + i))
        entries.append(entry.name)
    other_size = await asyncio.to_thread(cache.publish, BASE, built.path,
                                         manifest.model_copy(update={"memory_mib": 512}))
    os.utime(other_size, (1, 1))
    other_name = await asyncio.to_thread(cache.publish, "base-net", built.path, manifest)
    os.utime(other_name, (1, 1))
    newest = await asyncio.to_thread(cache.publish, BASE, built.path,
                                     manifest.model_copy(update={"qemu_version": "8.0"}))
    left = sorted(p.name for p in cache.root.iterdir() if p.name != ".lock")
    assert left == sorted([newest.name, entries[2], other_size.name, other_name.name])
    assert first.name not in left


class _Link:
    def __init__(self) -> None:
        self.registered: list[NodeRegister] = []

    async def register(self, req: NodeRegister) -> str:
        self.registered.append(req)
        return "node-x"

    async def heartbeat(self, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
        raise AssertionError("the test ends before the first heartbeat is due")

    async def leave(self, node_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_node_registers_only_once_its_base_template_is_in_place(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "image")
    gate = asyncio.Event()
    real_boot = runtime.boot

    async def slow_boot(spec: VMSpec, sandbox_id: str | None = None) -> Any:
        await gate.wait()  # the base build's cold boot
        return await real_boot(spec, sandbox_id)

    runtime.boot = slow_boot  # type: ignore[method-assign]
    source = TemplateSource(runtime, image, pool_size=0, bind=runtime.bind_identity)
    agent = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 32, 16))
    (tmp_path / "pool").mkdir()
    storage = StoragePool.open(tmp_path, StorageSettings(path=tmp_path / "pool"))
    link = _Link()
    service = NodeService(NodeParts(agent=agent, storage=storage), link, uds=tmp_path / "node.sock",
                          heartbeat_interval=3600)
    await agent.start()
    starting = asyncio.create_task(service.start())
    try:
        await asyncio.sleep(0.5)
        assert not starting.done() and link.registered == []  # serving its API, not registered: not ready
        gate.set()
        assert await asyncio.wait_for(starting, 30) == "node-x"
        assert len(link.registered) == 1 and "base" in link.registered[0].templates
        assert source.store.find(BASE, 256, 1) is not None and runtime.boots == 1
    finally:
        gate.set()
        if not starting.done():
            starting.cancel()
        await service.stop()

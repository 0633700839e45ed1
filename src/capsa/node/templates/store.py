"""Templates: snapshots of booted guests that every session sandbox is restored from.

A template lives in the storage pool as ``templates/tpl-<name>-m<MiB>c<vcpus>/`` holding ``template.json``
(the record below) and one snapshot directory. ``base`` is the node's guest image booted once and
snapshotted; it is rebuilt whenever the image, the QEMU version or the QEMU device layout changes, because
a snapshot from another layout cannot be restored. Custom templates are built from a :class:`TemplateSpec`
by :mod:`capsa.node.templates.build` and stored the same way. Only template builds ever cold-boot a VM.

With a :class:`~capsa.node.templates.cache.TemplateCache` (the node's image cache dir), node-built templates
(``base``, ``base-net``) are copied there once built and imported from there by a node that lacks them (a
fresh state directory), keyed by image, QEMU version, device layout and size: no cold boot at all then.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.runtime.base import GuestImage, RamMode, Sandbox, SnapshottingRuntime, VMSpec
from capsa.node.runtime.snapshot.manifest import Snapshot, SnapshotError, SnapshotManifest
from capsa.node.templates.cache import TemplateCache

__all__ = [
    "BASE",
    "NET_TEMPLATE_MAC",
    "PUBLISH_WAIT",
    "RECORD_FILE",
    "WARM_UP_COMMANDS",
    "Template",
    "TemplateStore",
    "check_template_name",
    "warm_up",
]

log = logging.getLogger(__name__)

BASE = "base"
NET_TEMPLATE_MAC = "02:ca:00:00:00:01"
"""The MAC of the NIC of templates snapshotted with one (``base-net``, specs with ``network: true``): every
sandbox has its own namespace, so equal MACs never meet."""
RECORD_FILE = "template.json"
_PREFIX = "tpl-"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_DIR_RE = re.compile(r"^tpl-(?P<name>[a-z0-9][a-z0-9_.-]{0,63})-m(?P<mem>[0-9]+)c(?P<cpu>[0-9]+)$")

Progress = Callable[[str], None]
PUBLISH_WAIT = 120.0
"""Seconds a closing store waits for template copies into the cache."""


def check_template_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise CapsaError(f"invalid template name {name!r} (lowercase letters, digits, '_', '.', '-'; "
                         "at most 64)", code="bad_request", status=400)
    return name


@dataclass(frozen=True)
class Template:
    """A stored template: its record and the snapshot it restores from."""

    name: str
    path: Path
    snapshot: Snapshot
    digest: str
    created_at: str
    spec: dict[str, Any] | None

    @property
    def memory_mib(self) -> int:
        return self.snapshot.manifest.memory_mib

    @property
    def vcpus(self) -> int:
        return self.snapshot.manifest.vcpus

    @property
    def image_digest(self) -> str:
        return self.snapshot.manifest.image_digest

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.name, self.memory_mib, self.vcpus)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.snapshot.path.iterdir() if p.is_file())

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "snapshot": self.snapshot.id,
                "memory_mib": self.memory_mib, "vcpus": self.vcpus, "image_digest": self.image_digest,
                "created_at": self.created_at, "spec": self.spec, "size_bytes": self.size_bytes()}


def _dir_name(name: str, memory_mib: int, vcpus: int) -> str:
    return f"{_PREFIX}{name}-m{memory_mib}c{vcpus}"


def template_digest(snapshot: Snapshot, spec: dict[str, Any] | None) -> str:
    """What the template holds: the snapshot files' hashes and the spec it was built from."""
    m = snapshot.manifest
    body = {"image": m.image_digest, "machine": m.machine, "qemu": m.qemu_version,
            "files": [(e.path, e.size, e.sha256) for e in (m.device_state, m.disk, m.ram) if e is not None],
            "spec": spec}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class TemplateStore:
    """Templates on one node's storage pool, and building ``base``."""

    def __init__(self, runtime: SnapshottingRuntime, image: GuestImage, *, base_memory_mib: int = 256,
                 base_vcpus: int = 1, cache: TemplateCache | None = None, warm_up_rounds: int = 2) -> None:
        self.runtime = runtime
        self.image = image
        self.base_memory_mib = base_memory_mib
        self.base_vcpus = base_vcpus
        self.cache = cache
        self.warm_up_rounds = warm_up_rounds
        """Rounds of :data:`WARM_UP_COMMANDS` run in a VM before its template snapshot (0: none)."""
        self._locks: dict[tuple[str, int, int], asyncio.Lock] = {}
        self._publishing: set[asyncio.Task[None]] = set()
        self.imports = 0
        """Templates imported from the cache (instead of built) by this store."""
        self.origins: dict[tuple[str, int, int], str] = {}
        """Where :meth:`ensure` last found each template: ``pool``, ``cache`` or ``built``."""

    @property
    def root(self) -> Path:
        return self.runtime.templates_dir

    # -- reading -----------------------------------------------------------------------------------------

    def _load(self, tdir: Path) -> Template | None:
        match = _DIR_RE.match(tdir.name)
        if match is None:
            return None
        try:
            record = json.loads((tdir / RECORD_FILE).read_text(encoding="utf-8"))
            snap = Snapshot.open(tdir / str(record["snapshot"]))
            return Template(name=match["name"], path=tdir, snapshot=snap, digest=str(record["digest"]),
                            created_at=str(record["created_at"]), spec=record.get("spec"))
        except (OSError, ValueError, KeyError, TypeError, SnapshotError) as exc:
            log.warning("ignoring unreadable template %s: %s", tdir, exc)
            return None

    def all(self) -> list[Template]:
        """Every stored template (all sizes), sorted by name then size."""
        found = []
        for tdir in sorted(self.root.glob(_PREFIX + "*")):
            if tdir.is_dir() and (t := self._load(tdir)) is not None:
                found.append(t)
        return sorted(found, key=lambda t: t.key)

    def names(self) -> list[str]:
        return sorted({t.name for t in self.all()} | {BASE})

    def variants(self, name: str) -> list[Template]:
        check_template_name(name)
        return [t for t in self.all() if t.name == name]

    def find(self, name: str, memory_mib: int, vcpus: int) -> Template | None:
        tdir = self.root / _dir_name(check_template_name(name), memory_mib, vcpus)
        return self._load(tdir) if tdir.is_dir() else None

    def is_current(self, template: Template, mac: str | None = None) -> bool:
        """Whether this node can restore the template (same image, QEMU and device layout); ``mac``: the
        template has a NIC with that MAC."""
        m = template.snapshot.manifest
        if m.image_digest != self.image.digest and template.name == BASE:
            return False
        return self._restorable(template.snapshot, mac)

    def _restorable(self, snapshot: Snapshot, mac: str | None) -> bool:
        m = snapshot.manifest
        network = SimpleNamespace(mac=mac) if mac is not None else None
        spec = VMSpec(image=self.image, memory_mib=m.memory_mib, vcpus=m.vcpus, network=network)
        return self.runtime.can_restore(snapshot, spec)

    async def resolve(self, name: str, memory_mib: int | None = None, vcpus: int | None = None) -> Template:
        """The template to restore a sandbox from; ``base`` variants are built on first use."""
        check_template_name(name)
        if name == BASE:
            return await self.ensure_base(memory_mib or self.base_memory_mib, vcpus or self.base_vcpus)
        variants = await asyncio.to_thread(self.variants, name)
        if not variants:
            raise CapsaError(f"template {name!r} not on this node", code="template_not_found", status=404)
        for t in variants:
            if memory_mib in (None, t.memory_mib) and vcpus in (None, t.vcpus):
                return t
        sizes = ", ".join(f"{t.memory_mib} MiB/{t.vcpus} vCPU" for t in variants)
        raise CapsaError(f"template {name!r} exists only as {sizes}, not {memory_mib} MiB/{vcpus} vCPU",
                         code="template_mismatch", status=409)

    # -- building ----------------------------------------------------------------------------------------

    def lock(self, key: tuple[str, int, int]) -> asyncio.Lock:
        """The lock held while the template ``key`` (name, MiB, vCPUs) is checked and (re)built."""
        return self._locks.setdefault(key, asyncio.Lock())

    async def ensure_base(self, memory_mib: int, vcpus: int, progress: Progress | None = None) -> Template:
        """The current ``base`` template of this size: on the pool, else from the cache, else cold-booted
        and snapshotted once (and then cached)."""
        say = progress or (lambda _m: None)

        async def build() -> Template:
            say(f"building template base ({memory_mib} MiB, {vcpus} vCPU): cold boot")
            return await self.build_base(memory_mib, vcpus, progress=say)

        return await self.ensure(BASE, memory_mib, vcpus, build, progress=say)

    async def build_base(self, memory_mib: int, vcpus: int, progress: Progress | None = None) -> Template:
        """Cold-boot the image and store it as ``base`` of this size (no cache, no lock: callers hold it)."""
        log.info("building the base template (%d MiB, %d vCPU)", memory_mib, vcpus)
        spec = VMSpec(image=self.image, memory_mib=memory_mib, vcpus=vcpus, labels={"template": BASE})
        sandbox = await self.runtime.boot(spec)
        return await self.store(BASE, sandbox, spec=None, progress=progress)

    async def ensure(self, name: str, memory_mib: int, vcpus: int,
                     build: Callable[[], Awaitable[Template]], *, mac: str | None = None,
                     progress: Progress | None = None, cache_name: str | None = None) -> Template:
        """The current node-built template ``name`` of this size (``mac``: with a NIC of that MAC): the
        pool's if it can be restored, else imported from the cache, else ``build()`` (then published to
        the cache in the background). ``cache_name``: its key in the cache when that is not ``name`` (a
        template built from a shipped spec: the name plus the spec's hash)."""
        key = (name, memory_mib, vcpus)
        async with self.lock(key):
            found = await asyncio.to_thread(self.find, name, memory_mib, vcpus)
            if found is not None and await asyncio.to_thread(self.is_current, found, mac):
                self.origins.setdefault(key, "pool")
                return found
            imported = await self._import_cached(name, memory_mib, vcpus, mac, progress, cache_name)
            if imported is not None:
                self.origins[key] = "cache"
                return imported
            template = await build()
            self.origins[key] = "built"
            if self.cache is not None:
                task = asyncio.create_task(self._publish(template, cache_name),
                                           name=f"template-cache-{name}")
                self._publishing.add(task)
                task.add_done_callback(self._publishing.discard)
            return template

    def cached(self, name: str, memory_mib: int, vcpus: int, mac: str | None = None) -> list[Path]:
        """Entries of the template cache this node could restore ``name`` of this size from, newest
        first (another QEMU, layout or image does not count)."""
        cache = self.cache
        if cache is None:
            return []
        try:
            entries = cache.candidates(name, self.image.digest, memory_mib, vcpus)
        except OSError as exc:
            log.warning("cannot read the template cache %s: %s", cache.root, exc)
            return []
        usable = self._usable(cache, entries, mac)
        if not usable and cache.store is not None:
            # Built once per fleet: another node may have put it in the store.
            def accept(manifest: SnapshotManifest) -> str | None:
                if self._restorable(Snapshot(cache.root, manifest), mac):
                    return None
                return (f"it was made with QEMU {manifest.qemu_version} under {manifest.accel} and another "
                        "device layout than this node's")

            usable = self._usable(cache, cache.fetch(name, self.image.digest, memory_mib, vcpus, accept), mac)
        return usable

    def _usable(self, cache: TemplateCache, entries: list[Path], mac: str | None) -> list[Path]:
        usable = []
        for entry in entries:
            manifest = cache.manifest(entry)
            snap_dir = cache.snapshot_dir(entry) if manifest is not None else None
            if manifest is None or snap_dir is None or manifest.image_digest != self.image.digest:
                continue
            if self._restorable(Snapshot(snap_dir, manifest), mac):
                usable.append(entry)
        return usable

    async def _import_cached(self, name: str, memory_mib: int, vcpus: int, mac: str | None,
                             progress: Progress | None, cache_name: str | None = None) -> Template | None:
        cache = self.cache
        if cache is None:
            return None
        for entry in await asyncio.to_thread(self.cached, cache_name or name, memory_mib, vcpus, mac):
            if progress is not None:
                progress(f"template {name} ({memory_mib} MiB, {vcpus} vCPU): from the cache {entry}")
            work = self.root / f".build-{secrets.token_hex(6)}"
            try:
                await asyncio.to_thread(cache.import_into, entry, work)
                final = self.root / _dir_name(name, memory_mib, vcpus)
                await asyncio.to_thread(_swap_in, work, final)
            except (OSError, CapsaError) as exc:
                await asyncio.to_thread(shutil.rmtree, work, True)
                log.warning("importing cached template %s failed: %s", entry, exc)
                continue
            template = await asyncio.to_thread(self._load, final)
            if template is not None and await asyncio.to_thread(self.is_current, template, mac):
                self.imports += 1
                log.info("template %s (%d MiB, %d vCPU) imported from the cache", name, memory_mib, vcpus)
                if cache.store is not None:  # made before the store was configured, or pushed by no one yet
                    task = asyncio.create_task(self._share(cache, entry, template),
                                               name=f"template-share-{name}")
                    self._publishing.add(task)
                    task.add_done_callback(self._publishing.discard)
                return template
            log.warning("cached template %s does not load after its import; building instead", entry)
        return None

    @staticmethod
    async def _share(cache: TemplateCache, entry: Path, template: Template) -> None:
        await asyncio.to_thread(cache.share, entry, template.snapshot.manifest)

    async def _publish(self, template: Template, cache_name: str | None = None) -> None:
        assert self.cache is not None
        try:
            entry = await asyncio.to_thread(self.cache.publish, cache_name or template.name, template.path,
                                            template.snapshot.manifest)
            log.info("template %s cached as %s", template.name, entry)
        except Exception as exc:
            log.warning("could not cache template %s: %s", template.name, exc)

    async def wait_published(self) -> None:
        """Until the templates built so far are in the cache (or failed to get there)."""
        while self._publishing:
            await asyncio.gather(*list(self._publishing), return_exceptions=True)

    async def close(self) -> None:
        """Let cache copies in progress finish (a node stopped right after its first build still leaves
        the cache warm), at most :data:`PUBLISH_WAIT` seconds, then give up on them."""
        pending = list(self._publishing)
        if not pending:
            return
        _done, late = await asyncio.wait(pending, timeout=PUBLISH_WAIT)
        for task in late:
            log.warning("gave up caching a template: still copying after %.0f s", PUBLISH_WAIT)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def store(self, name: str, sandbox: Sandbox, *, spec: dict[str, Any] | None,
                    progress: Progress | None = None, restore_spec: VMSpec | None = None) -> Template:
        """Snapshot ``sandbox`` as template ``name`` (replacing one of the same size), then destroy it.

        A sandbox whose RAM is private (a build VM: its snapshot carries the RAM in the stream) is
        restored once from that snapshot with its RAM in a file (``restore_spec``: the spec to restore
        it with, its network included) and snapshotted again, so every template restores from a RAM file.
        The sandbox is destroyed in every case. The old template of that name and size stays in place
        until the new one is complete.
        """
        say = progress or (lambda _m: None)
        check_template_name(name)
        work = self.root / f".build-{secrets.token_hex(6)}"
        try:
            work.mkdir(mode=0o711)
            if self.warm_up_rounds:
                say("warming up the command path")
                await warm_up(sandbox, self.warm_up_rounds)
            with contextlib.suppress(Exception):
                # Written data is in the guest's page cache: flush it into the disk image first.
                await sandbox.guest.exec(["sync"], timeout=60)
            say("snapshotting")
            # A private-RAM build VM's snapshot carries its RAM in the stream and is replaced below by one
            # with a RAM file: only the snapshot that is kept is worth hashing (its disk is gigabytes).
            kept = restore_spec is None or not restore_spec.private_ram
            snap = await self.runtime.snapshot(sandbox, work / new_id("snap"), resume=False,
                                               labels={"capsa.template": name}, content_digest=kept)
        except BaseException:
            await self.runtime.destroy(sandbox)
            await asyncio.to_thread(shutil.rmtree, work, True)
            raise
        await self.runtime.destroy(sandbox)
        if restore_spec is not None and (snap.manifest.ram is None or not kept):
            try:
                snap = await self._ram_into_file(snap, restore_spec, work, name, say)
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, work, True)
                raise
        final = self.root / _dir_name(name, snap.manifest.memory_mib, snap.manifest.vcpus)
        try:
            record = {"name": name, "snapshot": snap.id, "digest": template_digest(snap, spec),
                      "created_at": datetime.now(UTC).isoformat(timespec="seconds"), "spec": spec}
            await asyncio.to_thread(_write_json, work / RECORD_FILE, record)
            await asyncio.to_thread(_swap_in, work, final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, work, True)
            raise
        template = await asyncio.to_thread(self._load, final)
        if template is None:
            raise SnapshotError(f"template {name} was stored but cannot be read back")
        say(f"template {name} stored: {template.digest}")
        return template

    async def _ram_into_file(self, streamed: Snapshot, spec: VMSpec, work: Path, name: str,
                             say: Progress) -> Snapshot:
        """The snapshot ``streamed`` (RAM in its stream) made again with the RAM in a file: restored with a
        shared RAM file, snapshotted, the first one removed."""
        say("moving its RAM into a file (one restore and snapshot)")
        vm = await self.runtime.restore(streamed, spec, ram_mode=RamMode.COPY)
        try:
            snap = await self.runtime.snapshot(vm, work / new_id("snap"), resume=False,
                                               labels={"capsa.template": name}, content_digest=True)
        finally:
            await self.runtime.destroy(vm)
        await asyncio.to_thread(shutil.rmtree, streamed.path)
        return snap

    def delete(self, name: str) -> int:
        """Remove every size of template ``name``; returns how many were removed."""
        check_template_name(name)
        n = 0
        for t in self.variants(name):
            _remove_tree(t.path)
            n += 1
        return n


WARM_UP_COMMANDS: tuple[str | list[str], ...] = (["true"], "echo warm")
"""Run (twice) in a VM before it is snapshotted as a template, once after every restore. A program run
straight and a shell command line with output: since commands are born in their cgroup (one exec, see
capsa.guest.cgroups), these two take every path a short command takes (spawn, exec, the shell, output
frames); ``sh -c true`` and a silent ``echo`` repeated those paths and added ~80 ms to a restore."""


async def warm_up(sandbox: Sandbox, rounds: int = 2, *, strict: bool = False) -> None:
    """Run the user command path (:data:`WARM_UP_COMMANDS`) ``rounds`` times.

    Before a template snapshot, so the snapshot holds the results: the shell, ``true`` and libc in the
    guest's page cache (no virtio-blk reads under TCG after a restore), the daemon's lazily imported
    modules and first-spawn set-up done. After a restore (``strict``: a failing command raises, the VM is
    not usable), for what a snapshot cannot keep: QEMU's translation cache and the RAM pages faulted in."""
    for _ in range(rounds):
        for cmd in WARM_UP_COMMANDS:
            if strict:
                result = await sandbox.guest.exec(cmd, timeout=60)
                if result.exit_code != 0:
                    raise CapsaError(f"warm-up command {cmd!r} exited with {result.exit_code}",
                                     code="sandbox_failed", status=500)
                continue
            with contextlib.suppress(Exception):
                await sandbox.guest.exec(cmd, timeout=60)


def _write_json(path: Path, body: dict[str, Any]) -> None:
    # 0600: a template's spec may name files and env that no VM uid should read (the directory is 0711).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _swap_in(work: Path, final: Path) -> None:
    # Sandboxes restored from the old template keep working: their disks are reflinks and private RAM
    # mappings pin the old file's pages until they exit.
    old: Path | None = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(work, final)
    if old is not None:
        _remove_tree(old)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

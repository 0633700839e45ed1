"""Node-built templates (``base``, ``base-net``) cached next to the guest image, so a fresh node restores its
first sandbox at once instead of cold-booting one to snapshot.

```
<cache_dir>/templates/                         root 0700
  .lock                                        flock: shared while importing, exclusive while publishing
  .tmp-<random>/                               an export in progress (swept by the next exporter)
  <name>-<image>-m<MiB>c<vcpus>-<layout>/      0700: a template directory as the node stores it
    template.json                              0600
    snap_<id>/                                 0700: manifest.json, state.bin, memory.ram, disk.img (0600)
```

``<image>`` is a hash of the image digest and ``<layout>`` one of the QEMU version, the device-layout
fingerprint (:func:`capsa.node.runtime.qemu.cmdline.machine_fingerprint`, which covers the accelerator,
memory and vCPUs) and the accelerator, all read from the snapshot's manifest. A lookup lists the entries
for (name, image, size) and lets the runtime pick one it can restore (``can_restore``), so a QEMU upgrade
or a layout change simply misses (and the next build publishes beside the old entry).

An entry only appears by ``rename`` of a finished work directory, under the exclusive lock; a reader
holds the shared lock while it copies, so a replacement never pulls files from under it. Everything is
root's and private: the RAM file is a booted guest's memory (kernel state, CRNG state before the reseed
every restore does), which no VM uid should read. Imports into the storage pool get the pool's modes:
directories 0711, files 0600, owned by the node.

With the fleet's store (``CAPSA_STORE_URL``) the cache is a window on it: every entry published here is
pushed as bundle ``template/<entry>`` (chunks in the shared ``templates`` scope), and a lookup that finds no
local entry a node can restore pulls one from the store whose manifest it can (:meth:`TemplateCache.fetch`),
so a template is built once per fleet. An entry made by another QEMU, layout or accelerator is left in
the store with the reason logged, and the node builds its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from capsa.node.runtime.snapshot.manifest import MANIFEST_FILE, SnapshotManifest, load_manifest
from capsa.node.storage.filecopy import SourceCheck, copy_file, write_back
from capsa.store.bundles import bundle_key, list_bundles, pull_bundle, push_bundle, read_bundle
from capsa.store.objects import ObjectStore, StoreError

__all__ = ["CACHE_SUBDIR", "STORE_KIND", "STORE_SCOPE", "TemplateCache", "entry_name", "entry_prefix"]

log = logging.getLogger(__name__)

CACHE_SUBDIR = "templates"
_LOCK = ".lock"
_TMP_PREFIX = ".tmp-"
_POOL_DIR_MODE = 0o711
_FILE_MODE = 0o600
_CACHE_DIR_MODE = 0o700
STORE_KIND = "template"
STORE_SCOPE = "templates"


def _short(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


KEEP = 2
"""Entries kept per template and size when a new one is published (the newest; older ones were made from
older images, specs or QEMU versions and are pruned)."""

_ENTRY_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9_-]*?)(?:\.[0-9a-f]{12})?"  # a shipped spec's hash
                       r"-r\d+-[0-9a-f]{16}-(?P<size>m\d+c\d+)-")

RECIPE = 3
"""How node-built templates are made (base; base-net with its prepared trust store; 3: networked templates
built on the one guest subnet every sandbox has, ``GUEST_SUBNET``). Bump it when that changes, so entries
made the old way are never imported."""


def entry_prefix(name: str, image_digest: str, memory_mib: int, vcpus: int) -> str:
    """The part of an entry's name a lookup knows before it has a snapshot."""
    return f"{name}-r{RECIPE}-{_short(image_digest)}-m{memory_mib}c{vcpus}-"


def entry_name(name: str, manifest: SnapshotManifest) -> str:
    """The cache entry of template ``name`` saved as ``manifest``."""
    layout = _short([manifest.qemu_version, manifest.machine, manifest.accel])
    return entry_prefix(name, manifest.image_digest, manifest.memory_mib, manifest.vcpus) + layout


def _copy_tree(src: Path, dst: Path, dir_mode: int, *, written_back: bool = False) -> None:
    """Copy a template directory (one level of subdirectories, regular files only) into ``dst`` (which
    must not exist), with ``dir_mode`` directories and 0600 files owned by this process; with
    ``written_back``, files that had to be copied (not reflinked) are on disk when this returns."""
    check = SourceCheck(owner=os.geteuid())
    dst.mkdir(mode=dir_mode)
    os.chmod(dst, dir_mode)  # whatever the umask
    for entry in sorted(src.iterdir()):
        if entry.is_symlink():
            raise OSError(f"refusing to copy {entry}: a symbolic link in a template")
        if entry.is_dir():
            _copy_tree(entry, dst / entry.name, dir_mode, written_back=written_back)
        # The files stay sparse; a reflink where both sides share a CoW filesystem.
        elif not copy_file(entry, dst / entry.name, mode=_FILE_MODE, check=check) and written_back:
            write_back(dst / entry.name)


class TemplateCache:
    """Templates cached under ``<cache_dir>/templates``."""

    def __init__(self, cache_dir: Path, store: ObjectStore | None = None) -> None:
        self.root = cache_dir / CACHE_SUBDIR
        self.store = store
        """The fleet's store, shared by every node (None: this cache is the node's own)."""

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.root.mkdir(mode=_CACHE_DIR_MODE, parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def candidates(self, name: str, image_digest: str, memory_mib: int, vcpus: int) -> list[Path]:
        """Cached entries for this template, image and size (any QEMU and layout), newest first."""
        if not self.root.is_dir():
            return []
        prefix = entry_prefix(name, image_digest, memory_mib, vcpus)
        found = [p for p in self.root.iterdir() if p.name.startswith(prefix) and p.is_dir()
                 and not p.is_symlink()]
        return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)

    @staticmethod
    def snapshot_dir(entry: Path) -> Path | None:
        """The snapshot directory inside a cached (or pool) template directory."""
        subdirs = [p for p in entry.iterdir() if p.is_dir() and (p / MANIFEST_FILE).is_file()]
        return subdirs[0] if len(subdirs) == 1 else None

    def manifest(self, entry: Path) -> SnapshotManifest | None:
        snap = self.snapshot_dir(entry)
        if snap is None:
            return None
        try:
            return load_manifest(snap)
        except Exception as exc:
            log.warning("ignoring unreadable cached template %s: %s", entry, exc)
            return None

    def import_into(self, entry: Path, dest: Path) -> None:
        """Copy the cached template ``entry`` to ``dest`` (a new directory in the storage pool), with the
        pool's modes. A failure leaves nothing at ``dest``."""
        with self._locked(exclusive=False):
            if not entry.is_dir():
                raise FileNotFoundError(f"cached template {entry} is gone")
            try:
                # Every restore reflinks these files: written back now, not by the first restore.
                _copy_tree(entry, dest, _POOL_DIR_MODE, written_back=True)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise

    def publish(self, name: str, template_dir: Path, manifest: SnapshotManifest) -> Path:
        """Copy a pool template directory into the cache as the entry for ``manifest`` (replacing an older
        copy of the same key); returns the entry."""
        final = self.root / entry_name(name, manifest)
        with self._locked(exclusive=True):
            # Whoever held the lock before us has finished or died: work dirs left are debris.
            for stale in self.root.glob(_TMP_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)
            work = self.root / f"{_TMP_PREFIX}{secrets.token_hex(6)}"
            try:
                _copy_tree(template_dir, work, _CACHE_DIR_MODE)
                if final.exists():
                    old = self.root / f"{_TMP_PREFIX}old-{secrets.token_hex(6)}"
                    os.rename(final, old)
                    os.rename(work, final)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            self._prune_locked(keep=KEEP)
        self.share(final, manifest)
        return final

    def share(self, entry: Path, manifest: SnapshotManifest) -> bool:
        """Push ``entry`` to the fleet's store unless it is there; True when it was pushed now. A store
        that fails is logged: the template stays this node's."""
        if self.store is None:
            return False
        try:
            if self.store.exists(bundle_key(STORE_KIND, entry.name)):
                return False
            with self._locked(exclusive=False):
                files = sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*")
                               if p.is_file() and not p.is_symlink())
                _, stats = push_bundle(self.store, STORE_KIND, entry.name, entry, files, scope=STORE_SCOPE,
                                       known=set(), meta={"manifest": manifest.model_dump(mode="json")})
        except (StoreError, OSError) as exc:
            log.warning("template %s could not be put in the store %s: %s", entry.name, self.store.url, exc)
            return False
        log.info("template %s put in the store %s: %d of %d chunks sent (%d bytes)", entry.name,
                 self.store.url, stats.sent_chunks, stats.chunks, stats.sent_bytes)
        return True

    def fetch(self, name: str, image_digest: str, memory_mib: int, vcpus: int,
              accept: Callable[[SnapshotManifest], str | None]) -> list[Path]:
        """Pull the store's entries of this template, image and size into this cache, those whose manifest
        ``accept`` finds restorable here (it answers None, or why not); returns the entries pulled."""
        if self.store is None:
            return []
        prefix = entry_prefix(name, image_digest, memory_mib, vcpus)
        pulled: list[Path] = []
        try:
            names = [n for n in list_bundles(self.store, STORE_KIND) if n.startswith(prefix)]
            for entry_name_ in names:
                final = self.root / entry_name_
                if final.exists():
                    continue
                bundle = read_bundle(self.store, STORE_KIND, entry_name_)
                manifest = SnapshotManifest.model_validate(bundle.meta.get("manifest"))
                why = accept(manifest)
                if why is not None:
                    log.warning("template %s in the store %s cannot be restored here: %s", entry_name_,
                                self.store.url, why)
                    continue
                with self._locked(exclusive=True):
                    if not final.exists():
                        pull_bundle(self.store, STORE_KIND, entry_name_, final)
                pulled.append(final)
                log.info("template %s pulled from the store %s (%d bytes)", entry_name_, self.store.url,
                         bundle.size)
        except (StoreError, OSError, ValueError) as exc:
            log.warning("templates in the store %s cannot be read: %s", self.store.url, exc)
        return pulled

    def _prune_locked(self, keep: int) -> list[Path]:
        """Drop all but the ``keep`` newest entries of each (template, size); the caller holds the exclusive
        lock. A node holding an imported copy is unaffected: imports are copies."""
        groups: dict[tuple[str, str], list[Path]] = {}
        for entry in self.root.iterdir():
            match = _ENTRY_RE.match(entry.name)
            if match is None or not entry.is_dir() or entry.is_symlink():
                continue
            groups.setdefault((match["name"], match["size"]), []).append(entry)
        removed = []
        for entries in groups.values():
            entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
            for old in entries[keep:]:
                doomed = self.root / f"{_TMP_PREFIX}gone-{secrets.token_hex(6)}"
                os.rename(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(old)
                log.info("pruned template cache entry %s", old.name)
        return removed

    def discard(self, entry: Path) -> None:
        """Remove a cached entry (unreadable or not restorable by anyone)."""
        with self._locked(exclusive=True):
            if entry.parent == self.root and entry.is_dir():
                doomed = self.root / f"{_TMP_PREFIX}gone-{secrets.token_hex(6)}"
                os.rename(entry, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

"""Snapshots that leave the node: pushed to the fleet's store when taken, pulled from it when restored here.

With a store (``CAPSA_STORE_URL``) every retained snapshot (pause, rolling and named snapshots) is pushed
before the call that took it answers, so a snapshot the control plane knows of can be restored by any node
that reads the store; the node's own copy becomes a cache. A restore or branch of a snapshot this node does
not hold pulls it first (a whole directory or nothing, every chunk's digest checked, then the manifest's).
Chunks go to the snapshot's tenant scope (``capsa.tenant``, sent by the control plane); a snapshot with no
tenant (a node used without a control plane) goes to the ``node`` scope. A chunk equal to one of a template
in the store (the disk blocks and RAM pages a session has not changed since its template) is referenced in
the shared ``templates`` scope instead of being stored again: templates are no tenant's secret.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from capsa.common.errors import CapsaError
from capsa.node.agent.node_metrics import ShippingMetrics
from capsa.node.runtime.snapshot.manifest import DISK_FILE, MANIFEST_FILE, RAM_FILE, STATE_FILE, Snapshot
from capsa.node.templates.cache import STORE_KIND as TEMPLATE_KIND
from capsa.store.bundles import bundle_key, delete_bundle, list_bundles, pull_bundle, push_bundle, read_bundle
from capsa.store.chunks import ChunkRef, TransferStats
from capsa.store.objects import ObjectMissing, ObjectStore, StoreError

__all__ = ["KIND", "LABEL_TENANT", "Shipper"]

log = logging.getLogger(__name__)

KIND = "snapshot"
LABEL_TENANT = "capsa.tenant"
_FILES = (MANIFEST_FILE, STATE_FILE, RAM_FILE, DISK_FILE)
_KNOWN_MAX = 1_000_000
"""Chunk refs remembered as present in the store (about 100 MB at most); forgotten all at once beyond."""


class Shipper:
    def __init__(self, store: ObjectStore, snapshots_dir: Path) -> None:
        self.store = store
        self.snapshots_dir = snapshots_dir
        self._known: set[ChunkRef] = set()
        self._templates: dict[str, set[ChunkRef]] = {}
        self._pulls: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.metrics = ShippingMetrics()
        """Bytes and time of its pushes and pulls (the agent registers them)."""

    def _remember(self) -> set[ChunkRef]:
        if len(self._known) > _KNOWN_MAX:
            self._known.clear()
        return self._known

    def _template_refs(self) -> set[ChunkRef]:
        """The chunks of the templates in the store (each template's index read once)."""
        names = set(list_bundles(self.store, TEMPLATE_KIND))
        for gone in set(self._templates) - names:
            del self._templates[gone]
        for name in names - set(self._templates):
            try:
                self._templates[name] = read_bundle(self.store, TEMPLATE_KIND, name).refs()
            except StoreError as e:  # deleted since the listing, or damaged: its chunks are not reused
                log.warning("template %s in the store cannot be read: %s", name, e)
        return set().union(*self._templates.values()) if self._templates else set()

    def _push(self, snap: Snapshot, scope: str, files: list[str]) -> TransferStats:
        _, stats = push_bundle(self.store, KIND, snap.id, snap.path, files, scope=scope,
                               known=self._remember(), reusable=self._template_refs())
        return stats

    async def _measured(self, direction: str, transfer: Callable[[], TransferStats], *, failure: str,
                        passes: tuple[type[StoreError], ...] = ()) -> tuple[TransferStats, float]:
        """Run ``transfer`` in a thread and record its time and bytes under ``direction`` (push, pull); a
        StoreError raises CapsaError(``"<failure>: <why>"``, 503), unless it is one of ``passes``."""
        started = time.monotonic()
        try:
            stats = await asyncio.to_thread(transfer)
        except passes:
            raise
        except StoreError as e:
            self.metrics.seconds.labels(direction, "error").observe(time.monotonic() - started)
            raise CapsaError(f"{failure}: {e}", code="store_unavailable", status=503) from e
        elapsed = time.monotonic() - started
        self.metrics.seconds.labels(direction, "ok").observe(elapsed)
        self.metrics.bytes.labels(direction).inc(stats.sent_bytes)
        return stats, elapsed

    async def push(self, snap: Snapshot) -> TransferStats:
        scope = snap.manifest.labels.get(LABEL_TENANT) or "node"
        files = [f for f in _FILES if (snap.path / f).is_file()]
        stats, elapsed = await self._measured(
            "push", lambda: self._push(snap, scope, files),
            failure=f"snapshot {snap.id} was taken but could not be written to the store")
        log.info("snapshot %s shipped to %s: %d of %d chunks sent (%d bytes) in %.2f s", snap.id,
                 self.store.url, stats.sent_chunks, stats.chunks, stats.sent_bytes, elapsed)
        return stats

    async def pull(self, snapshot_id: str) -> bool:
        """Bring ``snapshot_id`` from the store into this node's snapshots unless it is here already; False
        when the store has none either. Concurrent pulls of one snapshot make one transfer."""
        lock = self._pulls.setdefault(snapshot_id, asyncio.Lock())
        async with lock:
            dest = self.snapshots_dir / snapshot_id
            if dest.is_dir():
                return True
            try:
                stats, elapsed = await self._measured(
                    "pull", lambda: pull_bundle(self.store, KIND, snapshot_id, dest)[1],
                    failure=f"snapshot {snapshot_id} could not be read from the store",
                    passes=(ObjectMissing,))
            except ObjectMissing:
                return False
        log.info("snapshot %s pulled from %s: %d chunks (%d bytes) in %.2f s", snapshot_id, self.store.url,
                 stats.sent_chunks, stats.sent_bytes, elapsed)
        return True

    async def holds(self, snapshot_id: str) -> bool:
        try:
            return await asyncio.to_thread(self.store.exists, bundle_key(KIND, snapshot_id))
        except StoreError as e:
            raise CapsaError(f"the store cannot be read: {e}", code="store_unavailable", status=503) from e

    async def forget(self, snapshot_id: str) -> None:
        """Delete the snapshot's index from the store (its chunks go when the collector runs)."""
        try:
            await asyncio.to_thread(delete_bundle, self.store, KIND, snapshot_id)
        except StoreError as e:
            raise CapsaError(f"snapshot {snapshot_id} could not be deleted from the store: {e}",
                             code="store_unavailable", status=503) from e

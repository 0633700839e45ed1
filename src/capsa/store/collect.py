"""Chunks that no bundle names any more are deleted: mark (every bundle index) and sweep (every chunk).

Chunks younger than ``grace_s`` are kept whatever the mark says: a push writes its chunks before its index,
so a chunk without an index may be one of a push in flight (on any node). Run by the control plane replica
that holds the maintenance lease, after retention dropped bundles.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from capsa.store.bundles import bundle_key, read_bundle
from capsa.store.chunks import chunk_key
from capsa.store.objects import ObjectStore, StoreError

__all__ = ["CollectStats", "collect_chunks"]

GRACE_S = 3600.0


class CollectStats(BaseModel):
    bundles: int = 0
    chunks: int = 0
    deleted: int = 0
    deleted_bytes: int = 0


def collect_chunks(store: ObjectStore, *, grace_s: float = GRACE_S, now: float | None = None) -> CollectStats:
    stats = CollectStats()
    live: set[str] = set()
    for obj in store.list("bundles/"):
        if not obj.key.endswith(".json"):
            continue
        _, kind, name = obj.key.split("/", 2)
        try:
            bundle = read_bundle(store, kind, name[:-5])
        except StoreError:
            if store.exists(bundle_key(kind, name[:-5])):
                raise  # an index that cannot be read: sweeping now could delete what it names
            continue  # deleted since the listing
        stats.bundles += 1
        live.update(chunk_key(r) for r in bundle.refs())
    cutoff = (time.time() if now is None else now) - grace_s
    for obj in store.list("chunks/"):
        stats.chunks += 1
        if obj.key not in live and obj.modified < cutoff:
            store.delete(obj.key)
            stats.deleted += 1
            stats.deleted_bytes += obj.size
    return stats

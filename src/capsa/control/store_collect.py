"""The control plane's share of the fleet's store: deleting chunks that no bundle names any more.

Nodes delete a snapshot's index when the control plane deletes the snapshot (close, retention, prune);
its chunks stay until this collection, run by the reaper of every replica at most once per
``store_collect_interval`` (a replica that finds nothing to delete costs the store two listings). Safe with
several replicas and with pushes in flight: a chunk is deleted only when no index names it and it is older
than the collector's grace period (:mod:`capsa.store.collect`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from capsa.control.plane import ControlPlane
from capsa.control.settings import ControlSettings
from capsa.store.collect import CollectStats, collect_chunks
from capsa.store.config import open_store
from capsa.store.objects import StoreError

__all__ = ["collect_store", "collect_unused", "collection_due"]

log = logging.getLogger(__name__)


def collection_due(settings: ControlSettings, last: float, now: float) -> bool:
    """Whether a replica that last collected at ``last`` (0: never) collects at ``now``."""
    return bool(settings.store_url) and (not last or now - last >= settings.store_collect_interval)


async def collect_unused(settings: ControlSettings) -> CollectStats | None:
    """Delete the store's chunks no bundle names (older than ``store_collect_grace``); None without a
    store or when it cannot be read (logged)."""
    if not settings.store_url:
        return None
    try:
        store = open_store(settings.store_url, s3_endpoint=settings.store_s3_endpoint)
        stats = await asyncio.to_thread(collect_chunks, store, grace_s=settings.store_collect_grace)
    except StoreError as e:
        log.warning("collecting the store's unused chunks failed: %s", e)
        return None
    if stats.deleted:
        log.info("store %s: %d unused chunks deleted (%d bytes) of %d, %d bundles", store.url, stats.deleted,
                 stats.deleted_bytes, stats.chunks, stats.bundles)
    return stats


async def collect_store(plane: ControlPlane) -> CollectStats | None:
    """The reaper's step: :func:`collect_unused` when it is due for this replica."""
    now = time.monotonic()
    if not collection_due(plane.settings, plane.store_collected_at, now):
        return None
    plane.store_collected_at = now
    return await collect_unused(plane.settings)

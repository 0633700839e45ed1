"""Putting a node together from its parts: storage pool, runtime, egress and the agent.

``capsa serve`` and ``capsa node`` both build their node here (:func:`build_node`), so the two run the same
agent with the same parts; the fast test stack plugs a fake runtime into the same assembly
(:func:`assemble_node`). :class:`NodeParts` owns what was built; :meth:`NodeParts.close` undoes all of it
(VMs, namespaces, the storage mount).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from capsa.common.egress_networks import EgressNetworkSettings
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.agent.agent import NodeAgent, snapshots_for
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.shipping import Shipper
from capsa.node.agent.snapshots import Snapshots
from capsa.node.egress.audit_log import AUDIT_FILE
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.trust_store import TrustStore
from capsa.node.runtime.base import RamMode, Runtime
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage.floor import MiB, SpaceFloor
from capsa.node.storage.pool import StoragePool, StorageSettings
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.source import SandboxSource, TemplateSource
from capsa.node.templates.warm_pool import PoolSettings
from capsa.store import store_from_settings

__all__ = ["NodeParts", "assemble_node", "build_node", "netns_prefix"]


def netns_prefix(state_dir: Path) -> str:
    """A namespace prefix of its own per state directory: stable across restarts (a restarted node removes
    what a crashed one left) and distinct from other nodes' (and tests') on the same host."""
    return "cs" + hashlib.sha256(str(state_dir).encode()).hexdigest()[:8] + "-"


@dataclass
class NodeParts:
    agent: NodeAgent
    storage: StoragePool | None = None
    """The storage pool build_node mounted (None for an agent on a runtime without one)."""

    async def close(self) -> None:
        try:
            await self.agent.close()
        finally:
            if self.storage is not None:
                await asyncio.to_thread(self.storage.unmount, lazy=True)


async def build_node(settings: Settings, image: GuestImage, *, node_id: str) -> NodeParts:
    """The agent for ``settings.state_dir``: sessions come from template snapshots (warm pool or restore on
    demand) on the node's storage pool (:class:`~capsa.node.templates.source.TemplateSource`), with the
    snapshots part (the QEMU runtime can snapshot) keeping the pool's free-space floor
    (``CAPSA_STORAGE_MIN_FREE_MIB``). Removes what a previous process on this state dir left behind."""
    storage_settings = StorageSettings()
    storage = await asyncio.to_thread(StoragePool.from_settings, settings, storage_settings)
    try:
        runtime = QemuRuntime(settings, accel=settings.accel, storage=PoolStorage(storage))
        pool_cfg = PoolSettings()
        # Sandbox namespaces and nftables need root; without it, sessions with a policy are refused
        # (egress_unavailable) and sessions without one run with no network, as always.
        secret = settings.approval_webhook_secret
        webhook_secret = secret.get_secret_value().encode() if secret is not None else None
        exceptions = EgressNetworkSettings()  # CAPSA_EGRESS_ALLOW_NETWORKS, CAPSA_EGRESS_UPSTREAM_PROXY
        egress = (NodeEgress.create(netns_prefix=netns_prefix(settings.state_dir),
                                    audit_path=Path(settings.state_dir) / AUDIT_FILE,
                                    internal_networks=exceptions.allow_networks,
                                    upstream_proxy=exceptions.proxy(),
                                    webhook_allow_networks=settings.webhook_allow_networks,
                                    webhook_secret=webhook_secret)
                  if os.geteuid() == 0 else None)
        # Node-built templates are cached beside the image: a fresh state dir restores from them at once;
        # with a fleet store, the cache also pushes to and pulls from it (built once per fleet).
        store = store_from_settings(settings)
        source = TemplateSource(runtime, image, egress=egress, pool_size=pool_cfg.size,
                                pool_sizes=pool_cfg.sizes, pool_refill_delay=pool_cfg.refill_delay,
                                cache=TemplateCache(settings.cache_dir, store),
                                ram_mode=RamMode.CLONE if settings.sandbox_ram == "private" else RamMode.COPY,
                                sharing=settings.template_sharing)
        floor = (SpaceFloor(storage.free_bytes, storage_settings.min_free_mib * MiB)
                 if storage_settings.min_free_mib else None)
        shipper = Shipper(store, storage.snapshots_dir) if store is not None else None
        return await assemble_node(runtime, image, node_id=node_id, source=source, egress=egress,
                                   snapshots=snapshots_for(runtime, source, floor=floor, shipper=shipper),
                                   storage=storage)
    except BaseException:
        await asyncio.to_thread(storage.unmount, lazy=True)
        raise


async def assemble_node(runtime: Runtime, image: GuestImage, *, node_id: str, source: SandboxSource,
                        snapshots: Snapshots | None, egress: NodeEgress | None = None,
                        capacity: NodeCapacity | None = None, trust: TrustStore | None = None,
                        storage: StoragePool | None = None) -> NodeParts:
    """The agent on these parts, started (what a previous process left behind removed, the source's
    template builds and warm pools begun); ``capacity``: default, the host's; ``trust``: default, the
    source's trust store. The caller undoes ``storage`` if this fails."""
    agent = NodeAgent(runtime, image, node_id=node_id, capacity=capacity, egress=egress, source=source,
                      snapshots=snapshots, trust=trust)
    await agent.start()
    return NodeParts(agent=agent, storage=storage)

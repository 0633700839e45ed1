"""The control plane's process-wide handles: settings, database, node connections.

Nothing here is state another replica would need: the database is the only source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from capsa.control.nodeclient import NodeClient, NodeClientPool
from capsa.control.settings import ControlSettings
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow

__all__ = ["ControlPlane"]


@dataclass
class ControlPlane:
    settings: ControlSettings
    engine: AsyncEngine
    db: async_sessionmaker[DbSession]
    nodes: NodeClientPool = field(default_factory=NodeClientPool)
    bootstrap_key: str | None = None
    """Set when this process generated the bootstrap admin key (shown once, never stored in clear)."""

    def node_client(self, node: NodeRow) -> NodeClient:
        return self.nodes.get(node.url, node.token)

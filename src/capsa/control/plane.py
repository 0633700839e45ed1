"""The control plane's process-wide handles: settings, database, node connections, rate-limit leases and
short-lived caches (API keys, running sessions).

Nothing here is state another replica would need: the database is the only source of truth. The rate
limiter's leases are units this replica already counted in the database and spends from memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from capsa.common.destinations import Resolver, SystemResolver
from capsa.control.audit.anchor import Checkpointer
from capsa.control.audit.writer import AuditWriter
from capsa.control.auth import KeyCache
from capsa.control.errors import ApiError
from capsa.control.metrics import ControlMetrics
from capsa.control.nodes.client import NodeClient, NodeClientPool, NodeError
from capsa.control.nodes.secrets import NodeSealer
from capsa.control.ratelimit import RateLimiter
from capsa.control.sessions.cache import SessionCache
from capsa.control.settings import ControlSettings
from capsa.control.store.db import DbSession, sqlite_thread_engine
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
    sealer: NodeSealer | None = None
    """Encrypts the node API tokens at rest; None when no key is configured (nodes cannot register)."""
    rates: RateLimiter = field(default_factory=RateLimiter)
    """This replica's rate-limit leases (:mod:`capsa.control.ratelimit`)."""
    keys: KeyCache = field(default_factory=lambda: KeyCache(0.0))
    """API key records this replica trusts for a few seconds (``CAPSA_KEY_CACHE_SECONDS``)."""
    sessions: SessionCache = field(default_factory=lambda: SessionCache(0.0))
    """Running sessions' rows this replica trusts for a few seconds (``CAPSA_SESSION_CACHE_SECONDS``)."""
    resolver: Resolver = field(default_factory=SystemResolver)
    """How this replica resolves the names it connects to on a tenant's behalf (OAuth providers); each
    answer is screened (:func:`capsa.common.destinations.screen_host`). Tests plug a static table in."""
    checkpoints: Checkpointer | None = None
    """Signs audit checkpoints into the anchor outside the database (:mod:`capsa.control.audit.anchor`);
    None when no signing key is configured."""
    metrics: ControlMetrics = field(default_factory=ControlMetrics)
    """This replica's Prometheus registry and series (``GET /metrics``, :mod:`capsa.control.metrics`)."""
    store_collected_at: float = 0.0
    """When (monotonic) this replica last collected the fleet store's unused chunks (0: never)."""
    audit: AuditWriter = field(init=False)
    """This replica's group-commit writer of API-call audit events (:mod:`capsa.control.audit.writer`)."""

    def __post_init__(self) -> None:
        linger = self.settings.audit_linger_ms / 1000 if self.settings.audit_ack == "async" else 0.0
        thread_engine = sqlite_thread_engine(self.engine, self.settings.sqlite_synchronous)
        self.audit = AuditWriter(self.engine, linger=linger, thread_engine=thread_engine)

    def node_sealer(self) -> NodeSealer:
        if self.sealer is None:
            raise ApiError("node API tokens are stored encrypted: set CAPSA_SECRET_KEY (or "
                           "CAPSA_SECRET_KEY_FILE) or CAPSA_BOOTSTRAP_KEY on the control plane",
                           code="secret_key_missing", status=503)
        return self.sealer

    def node_client(self, node: NodeRow) -> NodeClient:
        """A client for the node, presenting the node's API token (decrypted here, never kept in clear).

        A token that cannot be read makes the node unreachable (``NodeError``, as every caller handles).
        """
        if node.token_sealed is None:
            raise NodeError("node_unreachable", 503, f"node {node.id} has no API token on record; "
                            "it must register again")
        try:
            token = self.node_sealer().open(node.id, node.token_sealed)
        except ApiError as exc:
            raise NodeError("node_unreachable", 503, exc.message) from None
        return self.nodes.get(node.url, token)

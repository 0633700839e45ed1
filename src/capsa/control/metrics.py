"""The control plane's Prometheus metrics: one registry per :class:`~capsa.control.plane.ControlPlane`
(never the process-wide default, so several planes in one process keep their series apart).

Two kinds of series:

- **counted by this replica** as things happen: API requests by route template and status, the latency
  of session operations (create, pause, resume, branch, restore, recover) by outcome, what became of
  sessions whose sandbox or node was lost, what the reaper did, and the orphan sandboxes heartbeats told
  nodes to destroy. Each replica counts what it did (every state change is won by exactly one replica),
  so the fleet's figure is the sum over replicas (``sum without (instance)``).
- **read from the database at scrape time** (:func:`read_fleet`): sessions by state, and each node's
  capacity, use, health and drain. Every replica reports the same figures (the database is shared): take
  ``max without (instance)``, not the sum.

Label values are bounded: states, operations and outcomes are fixed sets, a route is its template
(``/v1/sessions/{session_id}``, never the raw path), and node ids are as many as the fleet has nodes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import Scope

from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow, SessionRow, utcnow

__all__ = ["SESSION_STATES", "ControlMetrics", "FleetFigures", "Operation", "read_fleet", "route_label",
           "timed"]

Operation = Literal["create", "pause", "resume", "branch", "restore", "recover"]
SESSION_STATES = ("creating", "running", "recovering", "paused", "closed", "failed")
"""Every state a session can be in (capsa.control.sessions.states): each is exported, 0 when empty."""
_RESOURCES = (("memory_mib", "memory_mib"), ("vcpus", "vcpus"), ("sandboxes", "max_sandboxes"))
"""(resource label, NodeRow capacity column): the ``used`` keys nodes report beside their capacity."""
_REAL_MEMORY = ("memory_pss_mib", "memory_available_mib")
"""``used`` keys a node with a memory guard adds: its sandboxes' PSS and the memory it has left."""
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNMATCHED = "unmatched"
"""The route label of a request no route matched (a 404 or a refusal before routing)."""


@dataclass(frozen=True)
class FleetFigures:
    """What the database says at one scrape."""

    sessions: dict[str, int]
    nodes: list[NodeRow]
    heartbeat_timeout: float


async def read_fleet(db: DbSession, heartbeat_timeout: float) -> FleetFigures:
    """Sessions by state (one grouped count) and every node's row."""
    counts = {str(state): int(n) for state, n in
              (await db.execute(select(SessionRow.state, func.count()).group_by(SessionRow.state))).all()}
    nodes = list((await db.execute(select(NodeRow).order_by(NodeRow.id))).scalars())
    return FleetFigures(counts, nodes, heartbeat_timeout)


class _FleetCollector(Collector):
    """Yields the figures last handed to it: the scrape reads the database, then renders at once (no await
    in between), so concurrent scrapes never see each other's figures half-way."""

    def __init__(self) -> None:
        self.figures: FleetFigures | None = None

    def collect(self) -> Iterator[Metric]:
        figures = self.figures
        if figures is None:
            return
        sessions = GaugeMetricFamily("capsa_sessions", "Sessions by state (read from the database)",
                                     labels=["state"])
        for state in SESSION_STATES:
            sessions.add_metric([state], figures.sessions.get(state, 0))
        for state in sorted(set(figures.sessions) - set(SESSION_STATES)):
            sessions.add_metric([state], figures.sessions[state])
        yield sessions
        capacity = GaugeMetricFamily("capsa_node_capacity", "A node's effective capacity by resource",
                                     labels=["node", "resource"])
        used = GaugeMetricFamily("capsa_node_used", "What a node's sandboxes hold (its last heartbeat)",
                                 labels=["node", "resource"])
        healthy = GaugeMetricFamily("capsa_node_healthy", "1 when the node heartbeats in time and has not "
                                    "left, else 0", labels=["node"])
        draining = GaugeMetricFamily("capsa_node_draining", "1 while an admin drains the node",
                                     labels=["node"])
        cutoff = utcnow() - timedelta(seconds=figures.heartbeat_timeout)
        for node in figures.nodes:
            for resource, column in _RESOURCES:
                capacity.add_metric([node.id, resource], float(getattr(node, column)))
                used.add_metric([node.id, resource], float((node.used or {}).get(resource, 0)))
            for resource in _REAL_MEMORY:
                if resource in (node.used or {}):
                    used.add_metric([node.id, resource], float(node.used[resource]))
            up = (node.left_at is None and node.token_sealed is not None and node.last_heartbeat_at >= cutoff)
            healthy.add_metric([node.id], 1.0 if up else 0.0)
            draining.add_metric([node.id], 1.0 if node.draining else 0.0)
        yield from (capacity, used, healthy, draining)


@dataclass
class ControlMetrics:
    """This replica's registry and the series it counts (see the module doc)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("capsa_http_requests", "API requests by method, route template and status",
                                ["method", "route", "status"], registry=r)
        self.request_seconds = Histogram("capsa_http_request_duration_seconds",
                                         "API request time until the answer's last byte, by route template",
                                         ["method", "route"], buckets=_REQUEST_BUCKETS, registry=r)
        self.operation_seconds = Histogram(
            "capsa_session_operation_duration_seconds",
            "Session operations (create, pause, resume, branch, restore, recover) by outcome",
            ["operation", "outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.sandbox_losses = Counter(
            "capsa_session_recoveries",
            "Sessions whose sandbox or node was lost, by what became of them "
            "(recovered on another node, paused at a snapshot, failed)", ["result"], registry=r)
        self.reaped = Counter("capsa_reaper_sessions",
                              "Sessions the reaper closed or paused (past their timeout), or failed (on a "
                              "lost node, or stuck creating)", ["action"], registry=r)
        self.orphans = Counter("capsa_orphan_sandboxes",
                               "Sandboxes a node reported that no active session owns, which its heartbeat "
                               "answer told it to destroy", registry=r)
        self._fleet = _FleetCollector()
        r.register(self._fleet)

    def request_done(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.request_seconds.labels(method, route).observe(seconds)

    def render(self, figures: FleetFigures) -> bytes:
        """The exposition text with ``figures`` as the database's series."""
        self._fleet.figures = figures
        try:
            return generate_latest(self.registry)
        finally:
            self._fleet.figures = None


def route_label(scope: Scope) -> str:
    """The template of the route that served the request (``/v1/sessions/{session_id}``; a mount's prefix
    included), or :data:`UNMATCHED`. FastAPI keeps an included router's routes without the include prefix
    and records the route as included (prefix and all) in ``scope["fastapi"]``; older versions copied the
    routes with the prefix."""
    route = scope.get("route")
    if route is None:
        return UNMATCHED
    fastapi = scope.get("fastapi")
    included = fastapi.get("effective_route_context") if isinstance(fastapi, dict) else None
    template = getattr(included, "path_format", None) or getattr(route, "path_format", None)
    if not isinstance(template, str):
        return UNMATCHED
    mount = scope.get("root_path", "")
    return mount + template if isinstance(mount, str) else template


_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


def timed(operation: Operation) -> Callable[[_F], _F]:
    """Observe the decorated session operation, whose first argument is the plane, in
    ``capsa_session_operation_duration_seconds``: outcome ``ok`` when it returns, ``error`` when it raises
    (a refusal, a node error, a cancellation)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            metrics: ControlMetrics = args[0].metrics
            started = time.perf_counter()
            outcome = "error"
            try:
                value = await fn(*args, **kwargs)
                outcome = "ok"
                return value
            finally:
                metrics.operation_seconds.labels(operation, outcome).observe(time.perf_counter() - started)

        return cast(_F, wrapper)

    return decorate

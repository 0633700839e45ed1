"""The node's Prometheus series beside the warm pool's (:class:`~capsa.node.templates.warm_pool.PoolMetrics`,
whose registry is the node's): each part keeps its own series, and :func:`register_parts` puts them in the
agent's registry, which ``GET /metrics`` renders.

- :class:`ShippingMetrics` (the :class:`~capsa.node.agent.shipping.Shipper`): bytes written to and read from
  the fleet's store and how long each transfer took, by outcome;
- :class:`~capsa.node.egress.metrics.EgressMetrics` (the egress audit log, where every decision of the
  broker is recorded): decisions by kind and outcome;
- :class:`AgentCollector`, read at scrape time: sandboxes running, and requests held for approval.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["AgentCollector", "ShippingMetrics", "register_parts"]

_TRANSFER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ShippingMetrics:
    """Snapshot transfers between this node and the fleet's store (not yet in any registry)."""

    def __init__(self) -> None:
        self.bytes = Counter("capsa_snapshot_store_bytes",
                             "Snapshot bytes moved to (push: compressed, new chunks only) or from (pull) the "
                             "fleet's store", ["direction"], registry=None)
        self.seconds = Histogram("capsa_snapshot_store_seconds",
                                 "Time to push a snapshot to the fleet's store or pull one from it",
                                 ["direction", "outcome"], buckets=_TRANSFER_BUCKETS, registry=None)

    def collectors(self) -> list[Collector]:
        return [self.bytes, self.seconds]


class AgentCollector(Collector):
    """Figures the agent holds, read at each scrape."""

    def __init__(self, sandboxes: Callable[[], int], approvals_pending: Callable[[], int]) -> None:
        self._sandboxes = sandboxes
        self._approvals = approvals_pending

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("capsa_sandboxes_running", "Sandboxes this node runs (pooled ones aside)",
                                value=self._sandboxes())
        yield GaugeMetricFamily("capsa_approvals_pending",
                                "Egress requests the broker holds until someone approves or denies them",
                                value=self._approvals())


def register_parts(registry: CollectorRegistry, parts: Iterable[Collector]) -> None:
    for part in parts:
        registry.register(part)

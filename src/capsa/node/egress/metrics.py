"""Egress decisions as Prometheus series: counted where the broker records every decision (the audit log,
:class:`~capsa.node.egress.audit_log.AuditLog`), before denials are aggregated; the node agent puts them in
its registry (:mod:`capsa.node.agent.node_metrics`)."""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.registry import Collector

from capsa.node.egress.audit import EgressEvent

__all__ = ["EgressMetrics"]


class EgressMetrics:
    """Not in any registry until the agent registers :meth:`collectors`."""

    def __init__(self) -> None:
        self.decisions = Counter("capsa_egress_decisions",
                                 "Egress decisions of the node's broker by kind (http, connect, tls, dns, "
                                 "net, approval, connection) and outcome (allow, deny, error); dropped "
                                 "packets count one each", ["kind", "decision"], registry=None)

    def record(self, event: EgressEvent) -> None:
        self.decisions.labels(event.kind, event.decision).inc(event.count)

    def collectors(self) -> list[Collector]:
        return [self.decisions]

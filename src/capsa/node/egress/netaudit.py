"""Turning the sandbox firewall's drop counters into audit events.

nftables drops what never reaches the broker (other ports, UDP, ICMP, IPv6, spoofed sources, packets
for other addresses); each drop class has a named counter in the sandbox namespace, and the node polls
them, emitting one ``net`` event per class whose count grew.
"""

from __future__ import annotations

from capsa.node.egress.audit import AuditSink, EgressEvent, emit_safely
from capsa.node.net.sandbox_net import NetworkManager, SandboxNet

__all__ = ["DropAuditor"]

_REASONS = {
    "drop_ipv6": "IPv6 traffic dropped",
    "drop_spoofed": "packet with a spoofed source address dropped",
    "drop_forward": "packet to an outside address dropped (no forwarding)",
    "drop_icmp": "ICMP to the node dropped",
    "drop_udp": "UDP to a port other than the DNS stub dropped",
    "drop_tcp": "TCP to a port other than the broker dropped",
    "drop_other": "invalid or other packet dropped",
    "drop_nonip": "frame that is neither IPv4 nor ARP dropped",
    "drop_output": "packet from the node side dropped",
}


class DropAuditor:
    """Remembers the last counter values of one sandbox and audits the increases."""

    def __init__(self, manager: NetworkManager, net: SandboxNet, sink: AuditSink,
                 session_id: str | None = None, sandbox_id: str | None = None) -> None:
        """``sandbox_id``: the sandbox the events are of, when it took over a network made for another id
        (a pooled VM's); default the network's own."""
        self.manager, self.net, self.sink, self.session_id = manager, net, sink, session_id
        self.sandbox_id = sandbox_id or net.sandbox_id
        self._last: dict[str, int] = {}

    async def poll(self) -> list[EgressEvent]:
        counters = await self.manager.drop_counters(self.net)
        events: list[EgressEvent] = []
        for name, value in sorted(counters.items()):
            delta = value - self._last.get(name, 0)
            if delta > 0:
                event = EgressEvent(kind="net", session_id=self.session_id, sandbox_id=self.sandbox_id,
                                    source=self.net.guest_ip, destination=name, decision="deny",
                                    rule=f"nftables:{name}", reason=_REASONS.get(name, name), count=delta)
                emit_safely(self.sink, event)
                events.append(event)
        self._last = counters
        return events

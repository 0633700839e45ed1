"""The node egress of a browser or desktop VM test: a broker that resolves names with the outside world's
DNS and trusts its CA (tests.support.outside), on a network pool of its own.

(The same as tests/integration/test_browser_vm.py's ``_egress``, which can move here.)
"""

from __future__ import annotations

import os
import ssl

from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.dns import DnsResolver
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from tests.support.outside import World

__all__ = ["site_egress"]


def site_egress(world: World, prefix: str) -> NodeEgress:
    """Sandbox networks in namespaces named ``prefix…``."""
    audit = AuditLog()
    store = InMemorySecretStore(SecretBox(os.urandom(32)))
    broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                          upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                          allow_networks=[world.net])
    manager = NetworkManager(netns_prefix=prefix)
    return NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)

"""The node of a browser or desktop VM test: egress whose broker resolves names with the outside world's
DNS and trusts its CA (tests.support.outside), on a network pool of its own, and the API stack on a
TemplateSource that restores every session of the template on demand (no warm pools)."""

from __future__ import annotations

import base64
import os
import ssl
from pathlib import Path

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.source import NET_TEMPLATE, TemplateSource
from tests.support.api_stack import ApiStack
from tests.support.outside import World
from tests.support.resolvers import DnsResolver

__all__ = ["site_egress", "template_stack"]


def site_egress(world: World, prefix: str) -> NodeEgress:
    """Sandbox networks in namespaces named ``prefix…``."""
    audit = AuditLog()
    store = InMemorySecretStore(SecretBox(os.urandom(32)))
    broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                          upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                          allow_networks=[world.net])
    manager = NetworkManager(netns_prefix=prefix)
    return NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)


def template_stack(state_dir: Path, pool: StoragePool, image: GuestImage, egress: NodeEgress,
                   template: str) -> tuple[TemplateSource, ApiStack]:
    """A real-VM API stack whose sessions of ``template`` are restores on demand (the template is built on
    first use or imported from the machine's template cache)."""
    settings = Settings(state_dir=state_dir, cache_dir=Settings().cache_dir)
    runtime = QemuRuntime(settings, storage=PoolStorage(pool))
    source = TemplateSource(runtime, image, egress=egress, cache=TemplateCache(settings.cache_dir),
                            pool_sizes={"base": 0, NET_TEMPLATE: 0, template: 0})
    key = base64.b64encode(os.urandom(32)).decode()
    stack = ApiStack(f"sqlite+aiosqlite:///{state_dir}/capsa.db", runtime, image, egress=egress,
                     source=source, settings={"secret_key": key, "reaper_interval": 0})
    return source, stack

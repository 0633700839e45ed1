"""What the node agent calls: one object that gives a sandbox its network and takes it away again.

``attach`` creates the namespace, tap and firewall, registers the sandbox with the broker and opens the
broker's listeners in the namespace; the returned :class:`AttachedNetwork` carries what the runtime needs
(namespace and tap to start QEMU in, guest addressing, MAC) and what the guest needs (CA certificate for
its trust store, environment with the proxy and the secret placeholders). ``detach`` undoes all of it
and checks that nothing is left. A background task turns firewall drop counters into audit events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.audit import AuditSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.netaudit import DropAuditor
from capsa.node.egress.sandboxes import PolicyUpdate
from capsa.node.net.sandbox_net import NetError, NetworkManager, SandboxNet

LOOPBACK_NAMES = "localhost,127.0.0.1,::1"
"""``NO_PROXY`` in a networked sandbox: its loopback stays direct."""

__all__ = ["AttachedNetwork", "EgressService"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttachedNetwork:
    net: SandboxNet
    ca_pem: bytes
    """Install in the guest trust store (e.g. /usr/local/share/ca-certificates/capsa-egress.crt)."""
    env: dict[str, str]
    """Environment for processes in the guest: proxy settings and secret placeholders."""
    networked: bool
    """False for a sandbox without a policy: it has a NIC, but nothing on the other side answers."""


class EgressService:
    def __init__(self, manager: NetworkManager, broker: EgressBroker, sink: AuditSink,
                 poll_interval: float = 2.0) -> None:
        self.manager, self.broker, self.sink = manager, broker, sink
        self.poll_interval = poll_interval
        self._attached: dict[str, tuple[SandboxNet, DropAuditor]] = {}
        self._poller: asyncio.Task[None] | None = None

    async def attach(self, sandbox_id: str, policy: EgressPolicy | None, *,
                     session_id: str | None = None, placeholders: Mapping[str, str] | None = None,
                     net: SandboxNet | None = None, networks: Sequence[str] = ()) -> AttachedNetwork:
        """``net``: a namespace and tap made earlier (a pooled VM's, :meth:`NetworkManager.create`) that
        the sandbox takes over, instead of new ones; from here on it is the sandbox's (also on failure).
        ``networks``: the internal networks its tenant was granted (EgressBroker.register)."""
        if net is None:
            net = await self.manager.create(sandbox_id)
        try:
            env: dict[str, str] = {}
            ca_pem = b""
            if policy is not None:
                sbx = self.broker.register(sandbox_id, net.guest_ip, policy, session_id=session_id,
                                           placeholders=placeholders, networks=networks)
                await self.broker.listen(sandbox_id, net.gateway_ip, netns=net.netns, ports=net.ports)
                ca_pem = sbx.ca.cert_pem
                # The sandbox's own loopback is not the outside: without NO_PROXY, a tool that honours
                # the proxy variables sends requests for 127.0.0.1 (a dev server, the browser's DevTools)
                # to the broker, which refuses them.
                env = {"HTTP_PROXY": net.proxy_url, "HTTPS_PROXY": net.proxy_url,
                       "http_proxy": net.proxy_url, "https_proxy": net.proxy_url,
                       "NO_PROXY": LOOPBACK_NAMES, "no_proxy": LOOPBACK_NAMES, **sbx.placeholder_env}
        except BaseException:
            await self.broker.unregister(sandbox_id)
            await self.manager.destroy(net)
            raise
        self._attached[sandbox_id] = (net, DropAuditor(self.manager, net, self.sink, session_id, sandbox_id))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_forever())
        return AttachedNetwork(net, ca_pem, env, policy is not None)

    def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                      placeholders: Mapping[str, str] | None = None,
                      networks: Sequence[str] | None = None) -> PolicyUpdate:
        return self.broker.update_policy(sandbox_id, policy, placeholders, networks)

    async def detach(self, sandbox_id: str) -> None:
        """Close listeners, forget CA and placeholders, remove namespace/tap/rules. Idempotent."""
        entry = self._attached.pop(sandbox_id, None)
        await self.broker.unregister(sandbox_id)
        if entry is None:
            return
        net, auditor = entry
        with contextlib.suppress(NetError):
            await auditor.poll()  # the last drops before the namespace goes
        await self.manager.destroy(net)
        left = await self.manager.leftovers(net)
        if left:
            raise NetError(f"network of {sandbox_id} not fully removed: {', '.join(left)}",
                           code="teardown_incomplete")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for sid in list(self._attached):
            await self.detach(sid)

    async def _poll_forever(self) -> None:
        while self._attached:
            await asyncio.sleep(self.poll_interval)
            for sid, (_net, auditor) in list(self._attached.items()):
                if sid not in self._attached:
                    continue
                try:
                    await auditor.poll()
                except NetError:
                    _log.debug("drop counters of %s unavailable", sid)

"""The node agent's egress: one broker, one secret store and one audit log for all of its sandboxes.

The control plane sends a session's policy (secret references only) and, separately, the values of the
secrets it binds; the values are kept encrypted under a key that exists only in this process's memory and
are dropped as soon as no sandbox on the node binds them any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capsa.common.destinations import Resolver, SystemResolver
from capsa.common.egress_networks import IPNetwork, UpstreamProxy
from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.egress.approvals import ApprovalBook
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.internal_networks import InternalNetworks
from capsa.node.egress.limits import raise_nofile
from capsa.node.egress.sandboxes import PolicyUpdate
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import AttachedNetwork, EgressService
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.egress.trust_store import CA_BUNDLE, CA_PATH
from capsa.node.egress.webhooks import WebhookNotifier
from capsa.node.net.sandbox_net import NETNS_PREFIX, NetworkManager, SandboxNet

__all__ = ["CA_BUNDLE", "CA_PATH", "EgressRequest", "NodeEgress"]


@dataclass(frozen=True)
class EgressRequest:
    """What a sandbox with a policy is attached with: the control plane's record of its session."""

    policy: EgressPolicy
    secrets: Mapping[str, str] = field(default_factory=dict)
    """Values of the secrets the policy binds, by id."""
    placeholders: Mapping[str, str] = field(default_factory=dict)
    """secret id -> the session's placeholder (what its guest holds); missing ones are made up."""
    session_id: str | None = None
    """The audit identity of the sandbox's events."""
    networks: Sequence[str] = ()
    """The networks (CIDRs) the session's tenant was granted: of the node's internal networks
    (``CAPSA_EGRESS_ALLOW_NETWORKS``), those its sandbox may reach."""


class NodeEgress:
    def __init__(self, service: EgressService, store: InMemorySecretStore, audit: AuditLog) -> None:
        self.service, self.store, self.audit = service, store, audit
        self._uses: dict[str, set[str]] = {}  # sandbox id -> secret ids its policy binds
        self._pool_nets: dict[str, SandboxNet] = {}  # networks of pooled VMs no sandbox has taken yet

    @classmethod
    def create(cls, *, netns_prefix: str = NETNS_PREFIX,
               resolver: Resolver | None = None, upstream_ssl: ssl.SSLContext | None = None,
               allow_networks: Sequence[str] = (), audit_path: Path | None = None,
               internal_networks: Sequence[IPNetwork] = (),
               upstream_proxy: UpstreamProxy | None = None,
               webhook_allow_networks: Sequence[IPNetwork] = (),
               webhook_secret: bytes | None = None) -> NodeEgress:
        """``netns_prefix`` names this node agent's namespaces; each agent on a host needs its own, since
        :meth:`cleanup_stale` removes every namespace with the prefix. ``audit_path``: the file that makes
        the audit buffer durable across node processes (memory only without one). ``internal_networks`` and
        ``upstream_proxy``: ``CAPSA_EGRESS_ALLOW_NETWORKS`` and ``CAPSA_EGRESS_UPSTREAM_PROXY``
        (capsa.common.egress_networks); ``allow_networks`` opens networks to every sandbox (tests only).
        ``webhook_allow_networks`` and ``webhook_secret``: ``CAPSA_WEBHOOK_ALLOW_NETWORKS`` and
        ``CAPSA_APPROVAL_WEBHOOK_SECRET`` (approval notifications, see webhooks.py)."""
        audit = AuditLog(path=audit_path)
        store = InMemorySecretStore(SecretBox(os.urandom(32)))
        raise_nofile()  # the broker's node-wide connection cap is bounded by the open-file limit
        notifier = WebhookNotifier(resolver or SystemResolver(), allow_networks=webhook_allow_networks,
                                   secret=webhook_secret)
        broker = EgressBroker(secrets=store, sink=audit, resolver=resolver, upstream_ssl=upstream_ssl,
                              allow_networks=allow_networks, tokens=ConnectionTokens(), notifier=notifier,
                              internal=InternalNetworks(tuple(internal_networks)),
                              upstream_proxy=upstream_proxy)
        return cls(EgressService(NetworkManager(netns_prefix=netns_prefix), broker, audit), store,
                   audit)

    @property
    def approvals(self) -> ApprovalBook:
        """Requests the broker holds for approval."""
        return self.service.broker.approvals

    @property
    def tokens(self) -> ConnectionTokens:
        """Access tokens of the connections its sandboxes bind; ``tokens.fetch`` is set by whoever links
        the node to the control plane."""
        return self.service.broker.tokens

    def revoke_connection(self, connection_id: str) -> None:
        """The control plane revoked the connection: no request of any sandbox here gets its token again."""
        self.tokens.revoke(connection_id)

    def network(self, sandbox_id: str) -> SandboxNet | None:
        """The sandbox's namespace, tap and addressing while it is attached."""
        entry = self.service._attached.get(sandbox_id)
        return entry[0] if entry is not None else None

    async def cleanup_stale(self) -> list[str]:
        """Remove namespaces (and their taps and rules) a previous process of this agent left behind."""
        keep = {net.sandbox_id for net, _ in self.service._attached.values()} | set(self._pool_nets)
        return await self.service.manager.cleanup_stale(keep=keep)

    def _store_secrets(self, sandbox_id: str, policy: EgressPolicy, values: Mapping[str, str]) -> None:
        wanted = {b.secret for b in policy.secrets}
        missing = sorted(wanted - set(values))
        if missing:
            raise CapsaError(f"no value sent for secret(s) {', '.join(missing)}", code="secret_not_found",
                             status=422)
        for secret_id in wanted:
            self.store.put(secret_id, values[secret_id])
        self._uses[sandbox_id] = wanted

    def _drop_unused(self) -> None:
        used = set().union(*self._uses.values()) if self._uses else set()
        for secret_id in list(self.store.ids()):
            if secret_id not in used:
                self.store.delete(secret_id)
        bound = self.service.broker.bound_connections()
        for connection_id in self.tokens.held():
            if connection_id not in bound:
                self.tokens.forget(connection_id)

    async def attach(self, sandbox_id: str, policy: EgressPolicy, values: Mapping[str, str], *,
                     session_id: str | None, placeholders: Mapping[str, str] | None = None,
                     net: SandboxNet | None = None, networks: Sequence[str] = ()) -> AttachedNetwork:
        """Give the sandbox its broker registration, listeners, CA and placeholders (``placeholders``:
        secret id -> the session's placeholder; missing ones are made up) on a new namespace and tap, or
        on ``net``, a pooled VM's network from :meth:`pool_network`, which the sandbox then owns. A policy
        whose approval webhook is refused (:meth:`check_policy`) is refused here."""
        if net is not None:
            self._pool_nets.pop(net.sandbox_id, None)
        try:
            await self.check_policy(policy)
            self._store_secrets(sandbox_id, policy, values)
        except BaseException:
            if net is not None:
                await asyncio.shield(self.service.manager.destroy(net))
            raise
        try:
            return await self.service.attach(sandbox_id, policy, session_id=session_id,
                                             placeholders=placeholders, net=net, networks=networks)
        except BaseException:
            self._uses.pop(sandbox_id, None)
            self._drop_unused()
            raise

    async def check_policy(self, policy: EgressPolicy) -> None:
        """Refuse (``destination_refused``, 422) a policy whose ``approval_webhook`` is, or resolves to, an
        address the node does not notify (screened again, and pinned, on every notification)."""
        if policy.approval_webhook:
            await self.service.broker.notifier.check(policy.approval_webhook)

    def update_policy(self, sandbox_id: str, policy: EgressPolicy, values: Mapping[str, str],
                      placeholders: Mapping[str, str] | None = None,
                      networks: Sequence[str] | None = None) -> PolicyUpdate:
        previous = self._uses.get(sandbox_id, set())
        self._store_secrets(sandbox_id, policy, values)
        try:
            update = self.service.update_policy(sandbox_id, policy, placeholders, networks)
        except BaseException:
            self._uses[sandbox_id] = previous
            raise
        finally:
            self._drop_unused()
        return update

    def placeholder_env(self, sandbox_id: str) -> dict[str, str]:
        return self.service.broker.get(sandbox_id).placeholder_env

    async def detach(self, sandbox_id: str) -> None:
        try:
            await self.service.detach(sandbox_id)
        finally:
            self._uses.pop(sandbox_id, None)
            self._drop_unused()

    @contextlib.asynccontextmanager
    async def throwaway_network(self) -> AsyncIterator[SandboxNet]:
        """A namespace and tap of their own with the sandbox firewall and no broker (nothing leaves them), for
        booting a VM with a NIC that no session uses (building a networked template); removed on exit."""
        manager = self.service.manager
        net = await manager.create(new_id("sbx"))
        try:
            yield net
        finally:
            await asyncio.shield(manager.destroy(net))

    async def pool_network(self) -> SandboxNet:
        """A namespace, tap and firewall (no broker: nothing leaves it) for a VM waiting in the warm pool;
        a sandbox takes it over in :meth:`attach`, or :meth:`release_network` removes it."""
        net = await self.service.manager.create(new_id("sbx"))
        self._pool_nets[net.sandbox_id] = net
        return net

    async def release_network(self, net: SandboxNet) -> None:
        """Remove a pooled VM's network that no sandbox took (idempotent)."""
        self._pool_nets.pop(net.sandbox_id, None)
        await self.service.manager.destroy(net)

    def pool_networks(self) -> list[SandboxNet]:
        return list(self._pool_nets.values())

    def holds_secret(self, secret_id: str) -> bool:
        return secret_id in self.store.ids()

    async def close(self) -> None:
        for net in list(self._pool_nets.values()):
            await self.release_network(net)
        await self.service.close()
        await self.service.broker.close()
        self.audit.close()
        self._uses.clear()
        self._drop_unused()

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

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker, PolicyUpdate
from capsa.node.egress.dns import Resolver
from capsa.node.egress.limits import raise_nofile
from capsa.node.egress.policy import EgressPolicy
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import AttachedNetwork, EgressService
from capsa.node.net.sandbox_net import NETNS_PREFIX, NetworkManager, SandboxNet

__all__ = ["CA_BUNDLE", "CA_PATH", "NodeEgress", "install_ca_script"]

CA_PATH = "/usr/local/share/ca-certificates/capsa-egress.crt"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def install_ca_script() -> list[str]:
    """The guest command that puts the file at CA_PATH into the system bundle (replacing an earlier one).

    The bundle is rebuilt from a copy of the image's own bundle plus our CA, not with update-ca-certificates:
    that rehashes every certificate and takes seconds under TCG, and a re-issued CA must replace, not join,
    the previous one.
    """
    script = (f'b={CA_BUNDLE}; [ -f "$b.capsa-base" ] || cp "$b" "$b.capsa-base" 2>/dev/null '
              f'|| : > "$b.capsa-base"; cat "$b.capsa-base" {CA_PATH} > "$b.capsa-tmp" '
              '&& mv "$b.capsa-tmp" "$b"')
    return ["sh", "-c", script]


class NodeEgress:
    def __init__(self, service: EgressService, store: InMemorySecretStore, audit: AuditLog) -> None:
        self.service, self.store, self.audit = service, store, audit
        self._uses: dict[str, set[str]] = {}  # sandbox id -> secret ids its policy binds

    @classmethod
    def create(cls, *, pool: str = "10.231.0.0/16", netns_prefix: str = NETNS_PREFIX,
               resolver: Resolver | None = None, upstream_ssl: ssl.SSLContext | None = None,
               allow_networks: Sequence[str] = ()) -> NodeEgress:
        """``netns_prefix`` names this node agent's namespaces; each agent on a host needs its own, since
        :meth:`cleanup_stale` removes every namespace with the prefix."""
        audit = AuditLog()
        store = InMemorySecretStore(SecretBox(os.urandom(32)))
        raise_nofile()  # the broker's node-wide connection cap is bounded by the open-file limit
        broker = EgressBroker(secrets=store, sink=audit, resolver=resolver, upstream_ssl=upstream_ssl,
                              allow_networks=allow_networks)
        return cls(EgressService(NetworkManager(pool=pool, netns_prefix=netns_prefix), broker, audit), store,
                   audit)

    def network(self, sandbox_id: str) -> SandboxNet | None:
        """The sandbox's namespace, tap and addressing while it is attached."""
        entry = self.service._attached.get(sandbox_id)
        return entry[0] if entry is not None else None

    async def cleanup_stale(self) -> list[str]:
        """Remove namespaces (and their taps and rules) a previous process of this agent left behind."""
        return await self.service.manager.cleanup_stale(keep=set(self.service._attached))

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

    async def attach(self, sandbox_id: str, policy: EgressPolicy, values: Mapping[str, str], *,
                     session_id: str | None) -> AttachedNetwork:
        self._store_secrets(sandbox_id, policy, values)
        try:
            return await self.service.attach(sandbox_id, policy, session_id=session_id)
        except BaseException:
            self._uses.pop(sandbox_id, None)
            self._drop_unused()
            raise

    def update_policy(self, sandbox_id: str, policy: EgressPolicy, values: Mapping[str, str]) -> PolicyUpdate:
        previous = self._uses.get(sandbox_id, set())
        self._store_secrets(sandbox_id, policy, values)
        try:
            update = self.service.update_policy(sandbox_id, policy)
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

    def holds_secret(self, secret_id: str) -> bool:
        return secret_id in self.store.ids()

    async def close(self) -> None:
        await self.service.close()
        await self.service.broker.close()
        self._uses.clear()
        self._drop_unused()

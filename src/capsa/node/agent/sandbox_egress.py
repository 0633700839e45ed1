"""One sandbox's egress while it is made: attach (onto a new or a pooled VM's network), then the CA install.

The agent hands :meth:`EgressHook.attach` and :meth:`EgressHook.prepare` to a sandbox source (creation) or
calls them itself around a snapshot restore (resume, rollback, branch); afterwards :attr:`EgressHook.env`
is what egress adds to the sandbox's env (proxy settings and the session's placeholders).
"""

from __future__ import annotations

from capsa.node.egress.node_egress import EgressRequest, NodeEgress
from capsa.node.egress.service import AttachedNetwork
from capsa.node.egress.trust_store import TrustStore
from capsa.node.net.sandbox_net import SandboxNet
from capsa.node.runtime.base import Sandbox

__all__ = ["EgressHook"]


class EgressHook:
    def __init__(self, egress: NodeEgress, trust: TrustStore, sandbox_id: str,
                 request: EgressRequest) -> None:
        self.egress, self.trust = egress, trust
        self.sandbox_id, self.request = sandbox_id, request
        self.attached: AttachedNetwork | None = None

    async def attach(self, net: SandboxNet | None) -> SandboxNet:
        """Register the sandbox with the broker and open its listeners on ``net`` (a pooled VM's, which
        the sandbox then owns) or on a new namespace and tap."""
        r = self.request
        self.attached = await self.egress.attach(self.sandbox_id, r.policy, r.secrets,
                                                 session_id=r.session_id, placeholders=r.placeholders,
                                                 net=net, networks=r.networks)
        return self.attached.net

    async def prepare(self, sandbox: Sandbox) -> None:
        """Install the sandbox's CA in its guest before its first command."""
        if self.attached is None:
            raise RuntimeError("prepare before attach")
        await self.trust.install(sandbox.guest, self.attached.ca_pem)

    @property
    def env(self) -> dict[str, str]:
        return dict(self.attached.env) if self.attached is not None else {}

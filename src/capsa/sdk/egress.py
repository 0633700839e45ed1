"""Egress from the SDK: stored secrets (``client.secrets``), a session's policy and its audit trail.

Secrets are write-only: :meth:`AsyncSecrets.create` sends a value once; nothing ever returns it. A session
refers to them in its policy (``{"secret": "<name or id>", "domain": ..., "env": "API_KEY"}``) and sees only
an opaque placeholder in that environment variable; the node swaps it for the value on the way out.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from typing import Any

from capsa.common.wire.egress import AuditEventOut, PolicyOut, SecretOut
from capsa.sdk.models import parse_items
from capsa.sdk.paths import seg
from capsa.sdk.resource import Resource, SessionResource

__all__ = ["AsyncEgress", "AsyncSecrets", "AuditEvent", "PolicyInfo", "SecretInfo"]


SecretInfo = SecretOut
"""A stored secret: its id, name and description, never its value."""
PolicyInfo = PolicyOut
"""A session's egress policy (None: the session has no network)."""
AuditEvent = AuditEventOut
"""One egress event of a session: a request, a DNS answer, a dropped packet class, an approval decided."""


class AsyncSecrets(Resource):
    """The tenant's stored secrets (``client.secrets``)."""

    async def create(self, name: str, value: str, *, description: str | None = None) -> SecretInfo:
        body = {"name": name, "value": value, "description": description}
        return await self._call(SecretInfo, "POST", "/secrets", json=body)

    async def list(self) -> builtins.list[SecretInfo]:
        return await self._list(SecretInfo, "/secrets")

    async def delete(self, secret: str) -> None:
        """Delete by id or name."""
        await self._client.request("DELETE", f"/secrets/{seg(secret)}")


class AsyncEgress(SessionResource):
    """One session's egress policy and audit trail (``session.egress``)."""

    async def policy(self) -> PolicyInfo:
        return await self._call(PolicyInfo, "GET", f"{self._base}/policy")

    async def set_policy(self, policy: Mapping[str, Any]) -> PolicyInfo:
        """Replace the running session's policy; it applies to its next request, without a restart."""
        return await self._call(PolicyInfo, "PUT", f"{self._base}/policy", json={"policy": dict(policy)})

    async def patch_policy(self, patch: Mapping[str, Any]) -> PolicyInfo:
        """Change the policy with an RFC 7396 merge patch (``None`` values remove keys)."""
        return await self._call(PolicyInfo, "PATCH", f"{self._base}/policy", json=dict(patch))

    async def iter_audit(self, *, decision: str | None = None, page_size: int = 200
                         ) -> AsyncIterator[AuditEvent]:
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if decision is not None:
                params["decision"] = decision
            if cursor is not None:
                params["cursor"] = cursor
            data = await self._client.json("GET", f"{self._base}/audit", params=params)
            for event in parse_items(AuditEvent, data):
                yield event
            cursor = data.get("next_cursor") if isinstance(data, dict) else None
            if not cursor:
                return

    async def audit(self, *, decision: str | None = None, limit: int | None = None
                    ) -> builtins.list[AuditEvent]:
        """The session's egress events, oldest first (all of them, or the first ``limit``)."""
        out: builtins.list[AuditEvent] = []
        async for event in self.iter_audit(decision=decision):
            out.append(event)
            if limit is not None and len(out) >= limit:
                break
        return out

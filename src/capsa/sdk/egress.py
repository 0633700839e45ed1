"""Egress from the SDK: stored secrets (``client.secrets``), a session's policy and its audit trail.

Secrets are write-only: :meth:`AsyncSecrets.create` sends a value once; nothing ever returns it. A session
refers to them in its policy (``{"secret": "<name or id>", "domain": ..., "env": "API_KEY"}``) and sees only
an opaque placeholder in that environment variable; the node swaps it for the value on the way out.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from capsa.sdk.models import parse, parse_items
from capsa.sdk.paths import seg

if TYPE_CHECKING:
    from capsa.sdk.client import AsyncClient

__all__ = ["AsyncEgress", "AsyncSecrets", "AuditEvent", "PolicyInfo", "SecretInfo"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class SecretInfo(_Model):
    id: str
    name: str
    description: str | None = None
    created_at: datetime


class PolicyInfo(_Model):
    session_id: str
    policy: dict[str, Any] | None
    """None: the session was created without a policy and has no network."""
    updated_at: datetime | None = None
    ca_reissued: bool = False


class AuditEvent(_Model):
    id: int
    session_id: str
    sandbox_id: str
    time: datetime
    kind: str
    """``http``, ``connect``, ``tls``, ``dns`` or ``net`` (dropped packets of one class)."""
    decision: str
    """``allow``, ``deny`` or ``error``."""
    source: str | None = None
    destination: str | None = None
    resolved_ip: str | None = None
    method: str | None = None
    path: str | None = None
    status: int | None = None
    bytes_out: int = 0
    bytes_in: int = 0
    rule: str | None = None
    reason: str | None = None
    secret_ids: list[str] = Field(default_factory=list)
    count: int = 1


class AsyncSecrets:
    """The tenant's stored secrets (``client.secrets``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, name: str, value: str, *, description: str | None = None) -> SecretInfo:
        body = {"name": name, "value": value, "description": description}
        return parse(SecretInfo, await self._client.json("POST", "/secrets", json=body))

    async def list(self) -> builtins.list[SecretInfo]:
        return parse_items(SecretInfo, await self._client.json("GET", "/secrets"))

    async def delete(self, secret: str) -> None:
        """Delete by id or name."""
        await self._client.request("DELETE", f"/secrets/{seg(secret)}")


class AsyncEgress:
    """One session's egress policy and audit trail (``session.egress``)."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self._client, self._session_id = client, session_id

    @property
    def _base(self) -> str:
        return f"/sessions/{seg(self._session_id)}"

    async def policy(self) -> PolicyInfo:
        return parse(PolicyInfo, await self._client.json("GET", f"{self._base}/policy"))

    async def set_policy(self, policy: Mapping[str, Any]) -> PolicyInfo:
        """Replace the running session's policy; it applies to its next request, without a restart."""
        data = await self._client.json("PUT", f"{self._base}/policy", json={"policy": dict(policy)})
        return parse(PolicyInfo, data)

    async def patch_policy(self, patch: Mapping[str, Any]) -> PolicyInfo:
        """Change the policy with an RFC 7396 merge patch (``None`` values remove keys)."""
        data = await self._client.json("PATCH", f"{self._base}/policy", json=dict(patch))
        return parse(PolicyInfo, data)

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

"""Blocking twins of :mod:`capsa.sdk.egress` (``Client.secrets``, ``Session.egress``)."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping
from typing import Any

from capsa.sdk.egress import AsyncEgress, AsyncSecrets, AuditEvent, PolicyInfo, SecretInfo
from capsa.sdk.portal import Blocking

__all__ = ["Egress", "Secrets"]


class Secrets(Blocking[AsyncSecrets]):
    """The tenant's stored secrets: write-only values, listed by metadata only."""

    def create(self, name: str, value: str, *, description: str | None = None) -> SecretInfo:
        return self._portal.call(self._inner.create(name, value, description=description))

    def list(self) -> builtins.list[SecretInfo]:
        return self._portal.call(self._inner.list())

    def delete(self, secret: str) -> None:
        self._portal.call(self._inner.delete(secret))


class Egress(Blocking[AsyncEgress]):
    """One session's egress policy and audit trail."""

    def policy(self) -> PolicyInfo:
        return self._portal.call(self._inner.policy())

    def set_policy(self, policy: Mapping[str, Any]) -> PolicyInfo:
        return self._portal.call(self._inner.set_policy(policy))

    def patch_policy(self, patch: Mapping[str, Any]) -> PolicyInfo:
        return self._portal.call(self._inner.patch_policy(patch))

    def iter_audit(self, *, decision: str | None = None, page_size: int = 200) -> Iterator[AuditEvent]:
        return self._portal.iterate(self._inner.iter_audit(decision=decision, page_size=page_size))

    def audit(self, *, decision: str | None = None, limit: int | None = None) -> builtins.list[AuditEvent]:
        return self._portal.call(self._inner.audit(decision=decision, limit=limit))

"""Blocking twin of :mod:`capsa.sdk.audit` (``Client.audit``)."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from datetime import datetime

from capsa.sdk.audit import AsyncAudit, AuditCheckpoint, AuditPage, AuditRecord, AuditVerification
from capsa.sdk.portal import Blocking

__all__ = ["Audit"]


class Audit(Blocking[AsyncAudit]):
    """The caller's tenant audit chain."""

    def page(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
             since: datetime | None = None, until: datetime | None = None, cursor: str | None = None,
             limit: int = 100) -> AuditPage:
        return self._portal.call(self._inner.page(session_id=session_id, kind=kind, since=since, until=until,
                                                  cursor=cursor, limit=limit))

    def iter(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
             since: datetime | None = None, until: datetime | None = None,
             page_size: int = 500) -> Iterator[AuditRecord]:
        return self._portal.iterate(self._inner.iter(session_id=session_id, kind=kind, since=since,
                                                     until=until, page_size=page_size))

    def list(self, *, session_id: str | None = None, kind: str | Sequence[str] | None = None,
             since: datetime | None = None, until: datetime | None = None,
             limit: int | None = None) -> builtins.list[AuditRecord]:
        return self._portal.call(self._inner.list(session_id=session_id, kind=kind, since=since, until=until,
                                                  limit=limit))

    def verify(self) -> AuditVerification:
        return self._portal.call(self._inner.verify())

    def checkpoint(self) -> AuditCheckpoint:
        return self._portal.call(self._inner.checkpoint())

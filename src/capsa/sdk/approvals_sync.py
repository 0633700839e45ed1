"""Blocking twin of :mod:`capsa.sdk.approvals` (``Client.approvals``)."""

from __future__ import annotations

import builtins
from typing import Literal

from capsa.sdk.approvals import ApprovalInfo, AsyncApprovals
from capsa.sdk.portal import Blocking

__all__ = ["Approvals"]


class Approvals(Blocking[AsyncApprovals]):
    """The tenant's held egress requests: list, approve, deny."""

    def list(self, *, session_id: str | None = None, include_decided: bool = False
             ) -> builtins.list[ApprovalInfo]:
        return self._portal.call(self._inner.list(session_id=session_id, include_decided=include_decided))

    def get(self, approval_id: str) -> ApprovalInfo:
        return self._portal.call(self._inner.get(approval_id))

    def approve(self, approval_id: str, *, scope: Literal["once", "session"] | None = None,
                reason: str | None = None) -> ApprovalInfo:
        return self._portal.call(self._inner.approve(approval_id, scope=scope, reason=reason))

    def deny(self, approval_id: str, *, reason: str | None = None) -> ApprovalInfo:
        return self._portal.call(self._inner.deny(approval_id, reason=reason))

"""Approvals from the SDK (``client.approvals``): egress requests a session's policy holds until someone
approves or denies them.

A policy rule with ``approvals`` makes the node's broker hold matching requests; :meth:`AsyncApprovals.list`
shows the pending ones (with a redacted preview of the body), :meth:`AsyncApprovals.approve` lets one through
(the sandbox gets the upstream's answer) and :meth:`AsyncApprovals.deny` answers it with a 403. The decision
is recorded under the API key that made it.
"""

from __future__ import annotations

import builtins
from typing import Any, Literal

from capsa.common.wire.approvals import ApprovalOut
from capsa.sdk.paths import seg
from capsa.sdk.resource import Resource

__all__ = ["ApprovalInfo", "AsyncApprovals"]


ApprovalInfo = ApprovalOut
"""A held egress request, pending or decided (``state``), with a redacted preview of its body."""


class AsyncApprovals(Resource):
    """The tenant's held egress requests (``client.approvals``)."""

    async def list(self, *, session_id: str | None = None, include_decided: bool = False
                   ) -> builtins.list[ApprovalInfo]:
        """Pending approvals, oldest first (of one session; with recently decided ones)."""
        params: dict[str, Any] = {}
        if session_id is not None:
            params["session_id"] = session_id
        if include_decided:
            params["include_decided"] = "true"
        return await self._list(ApprovalInfo, "/approvals", params=params)

    async def get(self, approval_id: str) -> ApprovalInfo:
        return await self._call(ApprovalInfo, "GET", f"/approvals/{seg(approval_id)}")

    async def approve(self, approval_id: str, *, scope: Literal["once", "session"] | None = None,
                      reason: str | None = None) -> ApprovalInfo:
        """Let the held request through; ``scope="session"`` also lets later requests of the session that
        the same rule matches through without asking."""
        return await self._decide(approval_id, "approve", scope, reason)

    async def deny(self, approval_id: str, *, reason: str | None = None) -> ApprovalInfo:
        """Refuse the held request (the sandbox gets a 403 naming the approval and ``reason``)."""
        return await self._decide(approval_id, "deny", None, reason)

    async def _decide(self, approval_id: str, verb: str, scope: str | None, reason: str | None
                      ) -> ApprovalInfo:
        body = {k: v for k, v in {"scope": scope, "reason": reason}.items() if v is not None}
        return await self._call(ApprovalInfo, "POST", f"/approvals/{seg(approval_id)}/{verb}", json=body)

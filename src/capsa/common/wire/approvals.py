"""Answers of ``/v1/approvals``: egress requests a node's broker holds until someone approves or denies
them (what the node API's ``ApprovalInfo`` says, as the tenant sees it)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from capsa.common.egress_policy import ApprovalScope, ApprovalState
from capsa.common.wire.base import Answer, known

__all__ = ["ApprovalList", "ApprovalOut"]


class ApprovalOut(Answer):
    """A request the egress broker holds until someone approves or denies it."""

    id: str
    session_id: str
    destination: str
    method: str
    path: str
    rule: str
    """The policy's domain rule the request matched."""
    approval_rule: str
    """The approval rule (its ``name``) that holds it; what a ``session`` approval covers."""
    scope: Annotated[str, known(ApprovalScope)]
    """The rule's scope while pending (``once`` or ``session``); what the approval covered once approved."""
    preview: str
    """The start of the request body (at most 2 KiB), secrets and placeholders redacted."""
    body_bytes: int
    created_at: datetime
    expires_at: datetime
    """No decision by then denies the request (``timeout``)."""
    state: Annotated[str, known(ApprovalState)]
    """``pending``, ``approved``, ``denied``, ``timeout`` or ``cancelled``."""
    decided_by: str | None = None
    """The API key id that decided."""
    decided_at: datetime | None = None
    reason: str | None = None


class ApprovalList(Answer):
    items: list[ApprovalOut]

"""The request body of ``/v1/approvals`` (its answers are :mod:`capsa.common.wire.approvals`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from capsa.common.egress_policy import ApprovalScope

__all__ = ["ApprovalDecisionIn"]


class ApprovalDecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: ApprovalScope | None = None
    """``once``: this request only; ``session``: also every later request of the session that this rule
    matches (while its sandbox runs). Default: the rule's scope."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    """Recorded in the audit trail (and, for a denial, told to the sandbox)."""

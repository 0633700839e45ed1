"""Request and response bodies of ``/v1/approvals``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from capsa.common.node_api import ApprovalInfo

__all__ = ["ApprovalDecisionIn", "ApprovalList", "ApprovalOut", "ApprovalState"]

ApprovalState = Literal["pending", "approved", "denied", "timeout", "cancelled"]


class ApprovalOut(BaseModel):
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
    scope: Literal["once", "session"]
    """The rule's scope while pending; what the approval covered once approved."""
    preview: str
    """The start of the request body (at most 2 KiB), secrets and placeholders redacted."""
    body_bytes: int
    created_at: datetime
    expires_at: datetime
    """No decision by then denies the request (``timeout``)."""
    state: ApprovalState
    decided_by: str | None = None
    """The API key id that decided."""
    decided_at: datetime | None = None
    reason: str | None = None

    @classmethod
    def of(cls, info: ApprovalInfo, session_id: str) -> ApprovalOut:
        def when(t: float | None) -> datetime | None:
            return datetime.fromtimestamp(t, UTC) if t is not None else None

        return cls(id=info.id, session_id=session_id, destination=info.destination, method=info.method,
                   path=info.path, rule=info.rule, approval_rule=info.approval_rule, scope=info.scope,
                   preview=info.preview, body_bytes=info.body_bytes,
                   created_at=datetime.fromtimestamp(info.created_at, UTC),
                   expires_at=datetime.fromtimestamp(info.expires_at, UTC), state=info.state,
                   decided_by=info.decided_by, decided_at=when(info.decided_at), reason=info.reason)


class ApprovalList(BaseModel):
    items: list[ApprovalOut]


class ApprovalDecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: Literal["once", "session"] | None = None
    """``once``: this request only; ``session``: also every later request of the session that this rule
    matches (while its sandbox runs). Default: the rule's scope."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    """Recorded in the audit trail (and, for a denial, told to the sandbox)."""

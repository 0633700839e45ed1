"""Approvals: the requests this node's egress broker holds for a decision, and the decisions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from capsa.common.node_api import APPROVAL_ID_PATTERN, ApprovalDecision, ApprovalInfo, ApprovalList
from capsa.node.api.deps import Agent

__all__ = ["router"]

router = APIRouter(tags=["approvals"])

ApprovalId = Annotated[str, Path(pattern=APPROVAL_ID_PATTERN)]


@router.get("/approvals", response_model=ApprovalList)
async def list_approvals(agent: Agent,
                         session: Annotated[list[str] | None, Query(max_length=1000)] = None,
                         include_decided: bool = False) -> ApprovalList:
    """Pending approvals (with ``include_decided``, also the recently decided ones), of the given sessions
    (every session when none is given)."""
    items = agent.approvals(session, include_decided=include_decided)
    return ApprovalList(items=[ApprovalInfo.model_validate(a) for a in items])


@router.get("/approvals/{approval_id}", response_model=ApprovalInfo)
async def get_approval(agent: Agent, approval_id: ApprovalId) -> ApprovalInfo:
    return ApprovalInfo.model_validate(agent.approval(approval_id))


@router.post("/approvals/{approval_id}/decision", response_model=ApprovalInfo)
async def decide(agent: Agent, approval_id: ApprovalId, body: ApprovalDecision) -> ApprovalInfo:
    """Approve or deny; ``approval_decided`` (409) when it was decided (or timed out) already."""
    decided = agent.decide_approval(approval_id, approve=body.approve, decided_by=body.decided_by,
                                    scope=body.scope, reason=body.reason, session_id=body.session_id)
    return ApprovalInfo.model_validate(decided)

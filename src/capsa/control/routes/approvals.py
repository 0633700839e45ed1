"""``/v1/approvals``: egress requests held for a person's (or a service's) decision."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from capsa.common.wire.approvals import ApprovalList, ApprovalOut
from capsa.control.approvals import service as approvals
from capsa.control.approvals.schemas import ApprovalDecisionIn
from capsa.control.deps import Caller, Plane, problems

__all__ = ["router"]

router = APIRouter(prefix="/approvals", tags=["approvals"], responses=problems(404, 409, 503))


@router.get("", response_model=ApprovalList)
async def list_approvals(plane: Plane, caller: Caller,
                         session_id: Annotated[str | None, Query(max_length=64)] = None,
                         include_decided: bool = False) -> ApprovalList:
    """The caller's tenant's pending approvals, oldest first (``session_id``: of one session;
    ``include_decided``: also the ones decided recently, while their nodes remember them)."""
    return await approvals.list_approvals(plane, caller.tenant, session_id, include_decided)


@router.get("/{approval_id}", response_model=ApprovalOut)
async def get_approval(approval_id: str, plane: Plane, caller: Caller) -> ApprovalOut:
    return await approvals.get_approval(plane, caller.tenant, approval_id)


@router.post("/{approval_id}/approve", response_model=ApprovalOut)
async def approve(approval_id: str, plane: Plane, caller: Caller,
                  body: Annotated[ApprovalDecisionIn | None, Body()] = None) -> ApprovalOut:
    """Let the held request through (the sandbox gets the upstream's answer); ``approval_decided`` (409) if it
    was decided or timed out already."""
    return await approvals.decide(plane, caller, approval_id, approve=True, body=body)


@router.post("/{approval_id}/deny", response_model=ApprovalOut)
async def deny(approval_id: str, plane: Plane, caller: Caller,
               body: Annotated[ApprovalDecisionIn | None, Body()] = None) -> ApprovalOut:
    """Refuse the held request: the sandbox gets a 403 naming the approval (and the reason)."""
    return await approvals.decide(plane, caller, approval_id, approve=False, body=body)

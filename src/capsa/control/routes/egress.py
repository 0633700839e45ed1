"""``/v1/sessions/{id}/policy`` and ``/v1/sessions/{id}/audit``: a session's egress policy and trail."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query

from capsa.common.wire.egress import AuditList, PolicyOut
from capsa.control.deps import Caller, Plane, problems
from capsa.control.egress import policy_update
from capsa.control.egress import service as egress
from capsa.control.egress.schemas import PolicyUpdate

__all__ = ["router"]

router = APIRouter(prefix="/sessions", tags=["egress"], responses=problems(404, 409, 503))


@router.get("/{session_id}/policy", response_model=PolicyOut)
async def get_policy(session_id: str, plane: Plane, caller: Caller) -> PolicyOut:
    return await egress.get_policy(plane, caller.tenant, session_id)


@router.put("/{session_id}/policy", response_model=PolicyOut)
async def replace_policy(session_id: str, body: PolicyUpdate, plane: Plane, caller: Caller) -> PolicyOut:
    """Replace the running session's policy; it applies to the next request, without a restart."""
    return await policy_update.update_policy(plane, caller.tenant, session_id, body.policy)


@router.patch("/{session_id}/policy", response_model=PolicyOut)
async def patch_policy(session_id: str, plane: Plane, caller: Caller,
                       body: Annotated[dict[str, Any], Body(
                           media_type="application/merge-patch+json",
                           description="RFC 7396 merge patch of the policy document")]) -> PolicyOut:
    return await policy_update.update_policy(plane, caller.tenant, session_id, None, patch=body)


@router.get("/{session_id}/audit", response_model=AuditList)
async def audit(session_id: str, plane: Plane, caller: Caller,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                cursor: Annotated[str | None, Query(max_length=64)] = None,
                decision: Literal["allow", "deny", "error"] | None = None) -> AuditList:
    """The session's egress events (requests, DNS queries, dropped packets), oldest first."""
    return await egress.list_audit(plane, caller.tenant, session_id, limit, cursor, decision)

"""``/v1/audit``: the caller's tenant audit chain (paged, filtered) and its verification."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from capsa.common.wire.audit import AuditChainList, AuditCheckpointOut, AuditKind, AuditVerifyOut
from capsa.control.audit import service as audit_api
from capsa.control.deps import Caller, Plane, problems

__all__ = ["router"]

router = APIRouter(prefix="/audit", tags=["audit"], responses=problems())

@router.get("", response_model=AuditChainList)
async def list_audit(plane: Plane, caller: Caller,
                     session_id: Annotated[str | None, Query(max_length=32)] = None,
                     kind: Annotated[list[AuditKind] | None, Query()] = None,
                     since: datetime | None = None, until: datetime | None = None,
                     cursor: Annotated[str | None, Query(max_length=20)] = None,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> AuditChainList:
    """The tenant's audit chain, oldest first: every API call, session change, command, file transfer,
    egress request and DNS answer, approval and connection use. Filters: ``session_id``, ``kind``
    (repeatable), ``since`` (inclusive) and ``until`` (exclusive)."""
    return await audit_api.list_chain(plane, caller.tenant, session_id=session_id, kinds=kind or [],
                                      since=since, until=until, cursor=cursor, limit=limit)


@router.get("/verify", response_model=AuditVerifyOut)
async def verify_audit(plane: Plane, caller: Caller) -> AuditVerifyOut:
    """Recompute the tenant's chain and compare it with the signed checkpoints outside the database;
    ``ok`` false names the first missing or altered event (``broken_id``) with a stable ``code``
    (``audit_chain_broken``, ``audit_chain_truncated``, ``audit_checkpoint_invalid``)."""
    return await audit_api.verify_chain(plane, caller.tenant)


@router.post("/checkpoints", response_model=AuditCheckpointOut, status_code=201)
async def checkpoint_audit(plane: Plane, caller: Caller) -> AuditCheckpointOut:
    """Sign the tenant's chain head into the anchor outside the database now (the newest checkpoint when
    the chain has not moved since). ``audit_checkpoints_disabled`` (409: a setting, not a fault) without a
    signing key; ``audit_chain_broken`` (409) when the chain no longer continues its last checkpoint."""
    return await audit_api.checkpoint_chain(plane, caller.tenant)

"""``/v1/egress-grants`` (admin only): which internal networks a tenant's sandboxes may reach.

A node opens a non-public destination only inside its ``CAPSA_EGRESS_ALLOW_NETWORKS`` and only for sandboxes
whose tenant holds a grant covering the address (capsa.control.egress.grants). Each grant and revocation is
chained into the granted tenant's audit trail and reaches its running sandboxes at once.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from capsa.control.deps import Admin, Plane, problems
from capsa.control.egress import grants as egress_grants
from capsa.control.egress import policy_update
from capsa.control.egress.grants import EgressGrantCreate, EgressGrantList, EgressGrantOut

__all__ = ["router"]

router = APIRouter(prefix="/egress-grants", tags=["egress"], responses=problems(403, 404, 409))

_Tenant = Annotated[str, Query(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


@router.post("", status_code=201, response_model=EgressGrantOut)
async def grant(body: EgressGrantCreate, plane: Plane, admin: Admin) -> EgressGrantOut:
    """Let ``tenant``'s sandboxes reach ``network`` where a node's ``CAPSA_EGRESS_ALLOW_NETWORKS``
    opens it."""
    out = await egress_grants.create_grant(plane, admin, body)
    await policy_update.refresh_networks(plane, body.tenant)
    return out


@router.get("", response_model=EgressGrantList)
async def list_grants(plane: Plane, _admin: Admin, tenant: _Tenant | None = None) -> EgressGrantList:
    return await egress_grants.list_grants(plane, tenant)


@router.delete("", response_model=EgressGrantOut)
async def revoke(plane: Plane, admin: Admin, tenant: _Tenant,
                 network: Annotated[str, Query(min_length=1, max_length=64)]) -> EgressGrantOut:
    """Take ``network`` away from ``tenant``; its running sandboxes lose it at once."""
    out = await egress_grants.revoke_grant(plane, admin, tenant, network)
    await policy_update.refresh_networks(plane, tenant)
    return out

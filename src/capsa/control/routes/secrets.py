"""``/v1/secrets``: write-only secret values the egress broker injects for a session's policy."""

from __future__ import annotations

from fastapi import APIRouter, Response

from capsa.common.wire.egress import SecretList, SecretOut
from capsa.control.deps import Caller, Plane, problems
from capsa.control.egress import service as egress
from capsa.control.egress.schemas import SecretCreate

__all__ = ["router"]

router = APIRouter(prefix="/secrets", tags=["secrets"], responses=problems(404, 409))


@router.post("", status_code=201, response_model=SecretOut)
async def create_secret(body: SecretCreate, plane: Plane, caller: Caller) -> SecretOut:
    """Store a secret (encrypted at rest). Its value is never returned by any call."""
    return await egress.create_secret(plane, caller.tenant, body)


@router.get("", response_model=SecretList)
async def list_secrets(plane: Plane, caller: Caller) -> SecretList:
    return await egress.list_secrets(plane, caller.tenant)


@router.delete("/{secret}", status_code=204, response_class=Response)
async def delete_secret(secret: str, plane: Plane, caller: Caller) -> Response:
    """Delete by id or name. Running sessions keep the copy their node holds until they end."""
    await egress.delete_secret(plane, caller.tenant, secret)
    return Response(status_code=204)

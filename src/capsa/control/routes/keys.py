"""``/v1/keys`` (admin only): create, list and revoke API keys."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select, update

from capsa.control.deps import Admin, Plane, problems
from capsa.control.errors import NotFound
from capsa.control.keys import generate_key, hash_key
from capsa.control.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyList, ApiKeyOut
from capsa.control.store.models import ApiKeyRow, utcnow

__all__ = ["router"]

router = APIRouter(prefix="/keys", tags=["keys"], responses=problems(403, 404))


def _out(row: ApiKeyRow) -> ApiKeyOut:
    return ApiKeyOut(id=row.id, tenant=row.tenant, admin=row.admin, name=row.name, created_at=row.created_at,
                     revoked_at=row.revoked_at)


@router.post("", status_code=201, response_model=ApiKeyCreated)
async def create_key(body: ApiKeyCreate, plane: Plane, _admin: Admin) -> ApiKeyCreated:
    key = generate_key()
    row = ApiKeyRow(id=key.key_id, secret_hash=hash_key(key.full), tenant=body.tenant, admin=body.admin,
                    name=body.name, created_at=utcnow())
    async with plane.db() as db:
        db.add(row)
        await db.commit()
    return ApiKeyCreated(key=key.full, **_out(row).model_dump())


@router.get("", response_model=ApiKeyList)
async def list_keys(plane: Plane, _admin: Admin) -> ApiKeyList:
    async with plane.db() as db:
        rows = await db.execute(select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id))
        return ApiKeyList(items=[_out(r) for r in rows.scalars()])


@router.delete("/{key_id}", response_model=ApiKeyOut)
async def revoke_key(key_id: str, plane: Plane, _admin: Admin) -> ApiKeyOut:
    async with plane.db() as db:
        await db.execute(update(ApiKeyRow).where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
                         .values(revoked_at=utcnow()))
        await db.commit()
        plane.keys.forget(key_id)
        row = await db.get(ApiKeyRow, key_id, populate_existing=True)
        if row is None:
            raise NotFound(f"key {key_id} not found")
        return _out(row)

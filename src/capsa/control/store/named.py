"""Rows a tenant names: an id, the tenant, and a name unique within the tenant (stored secrets, connection
providers, connections), and the queries every such table is read with.

:class:`TenantNamed` declares the three columns and the ``uq_<table>_tenant_name`` constraint, as the
migrations created them; :func:`add_named` inserts a row (refused when its name is taken), :func:`by_tenant`
and :func:`by_ref` select them, :func:`list_named` lists a tenant's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Select, String, UniqueConstraint, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from capsa.common.ids import is_id
from capsa.control.errors import ApiError
from capsa.control.store.db import DbSession

__all__ = ["TenantNamed", "add_named", "by_ref", "by_tenant", "list_named"]


class TenantNamed:
    """Mixin of a table's ``id``, ``tenant`` and ``name`` columns (name unique within the tenant)."""

    __tablename__: str

    # First in the table, as the migrations created them (a mixin's columns otherwise come last).
    id: Mapped[str] = mapped_column(String(32), primary_key=True, sort_order=-1)
    tenant: Mapped[str] = mapped_column(String(64), sort_order=-1)
    name: Mapped[str] = mapped_column(String(128), sort_order=-1)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        return (UniqueConstraint("tenant", "name", name=f"uq_{cls.__tablename__}_tenant_name"),)


R = TypeVar("R", bound=TenantNamed)
T = TypeVar("T")


async def add_named(db: DbSession, row: TenantNamed, what: str) -> None:
    """Add ``row`` and commit; refused (409 ``already_exists``, "a <what> named … exists") when its tenant
    has a row of its table by that name."""
    row_type = type(row)
    taken = await db.scalar(select(func.count()).select_from(row_type).where(row_type.tenant == row.tenant,
                                                                             row_type.name == row.name))
    if taken:
        raise ApiError(f"a {what} named {row.name!r} exists", code="already_exists", status=409)
    db.add(row)
    await db.commit()


def by_tenant(row_type: type[R], tenant: str) -> Select[R]:
    """The tenant's rows of this table, by name."""
    return select(row_type).where(row_type.tenant == tenant).order_by(row_type.name)


async def list_named(db: async_sessionmaker[DbSession], row_type: type[R], tenant: str,
                     out: Callable[[R], T]) -> list[T]:
    """The tenant's rows of this table, by name, each as ``out(row)`` (read in a session of its own)."""
    async with db() as session:
        return [out(row) for row in await session.scalars(by_tenant(row_type, tenant))]


def by_ref(row_type: type[R], tenant: str, ref: str, id_prefix: str) -> Select[R]:
    """The tenant's row named ``ref``, or whose id it is when it is an id (``<id_prefix>_…``)."""
    column = row_type.id if is_id(ref, id_prefix) else row_type.name
    return select(row_type).where(row_type.tenant == tenant, column == ref)

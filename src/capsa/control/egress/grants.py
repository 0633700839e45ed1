"""Egress grants: an admin lets a tenant's sandboxes reach internal networks, and policies are checked
against them.

A node opens non-public destinations only inside its ``CAPSA_EGRESS_ALLOW_NETWORKS``, and there only for a
sandbox whose tenant holds a grant covering the address (sent with every sandbox start and policy update:
:func:`tenant_networks`). Granting and revoking are admin-only API actions, chained into the granted
tenant's audit trail (kind ``egress``, actions ``network_granted`` / ``network_revoked``). The route then
sends the tenant's running sandboxes their new grants
(:func:`capsa.control.egress.policy_update.refresh_networks`), so a revocation holds at once.

When a policy is set, :func:`check_policy_networks` resolves its exact (non-wildcard) domains and refuses
one that resolves into the operator's networks when no grant of the tenant covers the address
(``egress_network_not_granted``). Names the control plane cannot resolve, and wildcards, are left to the
broker, which refuses them when a request is made.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork
from sqlalchemy import delete, select

from capsa.common.egress_networks import EgressNetworkSettings, IPNetwork, covers
from capsa.control.audit import trail as audit_trail
from capsa.control.auth import Principal
from capsa.control.errors import ApiError, NotFound
from capsa.control.plane import ControlPlane
from capsa.control.store.grant_models import EgressGrantRow
from capsa.control.store.models import utcnow

__all__ = [
    "EgressGrantCreate",
    "EgressGrantList",
    "EgressGrantOut",
    "NetworkNotGranted",
    "check_policy_networks",
    "create_grant",
    "list_grants",
    "operator_networks",
    "revoke_grant",
    "tenant_networks",
]

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 2.0
"""How long a policy check waits for the names of a policy (all at once); unanswered names pass."""

_Tenant = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


class EgressGrantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: _Tenant
    network: IPvAnyNetwork
    """A CIDR with no host bits set (``10.20.0.0/16``, ``10.20.0.5/32``)."""
    note: Annotated[str, Field(max_length=500)] | None = None


class EgressGrantOut(BaseModel):
    tenant: str
    network: str
    note: str | None
    created_at: datetime
    created_by: str
    """The admin key that granted it."""


class EgressGrantList(BaseModel):
    items: list[EgressGrantOut]


class NetworkNotGranted(ApiError):
    code, status, title = "egress_network_not_granted", 422, "Internal network not granted"


def _out(row: EgressGrantRow) -> EgressGrantOut:
    return EgressGrantOut(tenant=row.tenant, network=row.network, note=row.note, created_at=row.created_at,
                          created_by=row.created_by)


def operator_networks() -> tuple[IPNetwork, ...]:
    """``CAPSA_EGRESS_ALLOW_NETWORKS`` as this process sees it (read on each call: tests change it)."""
    return EgressNetworkSettings().allow_networks


async def tenant_networks(plane: ControlPlane, tenant: str) -> list[str]:
    """The networks ``tenant`` was granted, as the node receives them."""
    async with plane.db() as db:
        rows = await db.scalars(select(EgressGrantRow.network).where(EgressGrantRow.tenant == tenant)
                                .order_by(EgressGrantRow.network))
        return list(rows)


async def create_grant(plane: ControlPlane, admin: Principal, body: EgressGrantCreate) -> EgressGrantOut:
    network = str(body.network)
    async with plane.db() as db:
        row = await db.get(EgressGrantRow, (body.tenant, network))
        if row is not None:
            raise ApiError(f"tenant {body.tenant} already holds {network}", code="already_exists", status=409)
        row = EgressGrantRow(tenant=body.tenant, network=network, note=body.note, created_at=utcnow(),
                             created_by=admin.key_id)
        db.add(row)
        await audit_trail.record(db, tenant=body.tenant, kind="egress", action="network_granted",
                                 key_id=admin.key_id,
                                 detail={"network": network, "note": body.note, "by_tenant": admin.tenant})
        await db.commit()
    return _out(row)


async def list_grants(plane: ControlPlane, tenant: str | None) -> EgressGrantList:
    async with plane.db() as db:
        query = select(EgressGrantRow).order_by(EgressGrantRow.tenant, EgressGrantRow.network)
        if tenant is not None:
            query = query.where(EgressGrantRow.tenant == tenant)
        return EgressGrantList(items=[_out(r) for r in await db.scalars(query)])


async def revoke_grant(plane: ControlPlane, admin: Principal, tenant: str, network: str) -> EgressGrantOut:
    try:
        canonical = str(ipaddress.ip_network(network))
    except ValueError:
        raise NotFound(f"tenant {tenant} holds no network {network}") from None
    async with plane.db() as db:
        row = await db.get(EgressGrantRow, (tenant, canonical))
        if row is None:
            raise NotFound(f"tenant {tenant} holds no network {canonical}")
        out = _out(row)
        await db.execute(delete(EgressGrantRow).where(EgressGrantRow.tenant == tenant,
                                                      EgressGrantRow.network == canonical))
        await audit_trail.record(db, tenant=tenant, kind="egress", action="network_revoked",
                                 key_id=admin.key_id,
                                 detail={"network": canonical, "by_tenant": admin.tenant})
        await db.commit()
    return out


async def _addresses(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


async def check_policy_networks(plane: ControlPlane, tenant: str, policy: Mapping[str, Any]) -> None:
    """Refuse (:class:`NetworkNotGranted`) a policy whose exact domains resolve into the operator's internal
    networks where the tenant holds no grant. No lookups at all when the operator opened none."""
    networks = operator_networks()
    if not networks:
        return
    hosts = sorted({str(r["domain"]) for r in policy.get("domains", ())
                    if not str(r.get("domain", "")).startswith("*.")})
    if not hosts:
        return
    granted: Sequence[IPNetwork] = [ipaddress.ip_network(n) for n in await tenant_networks(plane, tenant)]
    lookups = [asyncio.ensure_future(_addresses(h)) for h in hosts]
    done, pending = await asyncio.wait(lookups, timeout=RESOLVE_TIMEOUT)
    for task in pending:
        task.cancel()
    for host, task in zip(hosts, lookups, strict=True):
        if task not in done:
            continue
        for address in task.result():
            addr = ipaddress.ip_address(address)
            if covers(networks, addr) and not covers(granted, addr):
                raise NetworkNotGranted(
                    f"{host} resolves to {address}, in an internal network tenant {tenant} is not granted; "
                    "an admin grants it with POST /v1/egress-grants")

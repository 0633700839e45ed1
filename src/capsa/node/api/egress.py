"""Egress: a running sandbox's policy, and the node's audit log of its sandboxes' connections."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from capsa.common.egress_policy import EgressPolicy
from capsa.common.node_api import AuditEvent, AuditPage, PolicyUpdate, PolicyUpdated
from capsa.node.api.deps import Agent

__all__ = ["router"]

router = APIRouter(tags=["egress"])


@router.put("/sandboxes/{sandbox_id}/policy", response_model=PolicyUpdated)
async def update_policy(agent: Agent, sandbox_id: str, body: PolicyUpdate) -> PolicyUpdated:
    reissued = await agent.update_policy(sandbox_id, EgressPolicy.from_data(body.policy),
                                         {k: v.get_secret_value() for k, v in body.secrets.items()},
                                         body.placeholders,
                                         None if body.granted_networks is None
                                         else [str(n) for n in body.granted_networks])
    return PolicyUpdated(ca_reissued=reissued)


@router.post("/connections/{connection_id}/revoke", status_code=204, response_class=Response)
async def revoke_connection(agent: Agent,
                            connection_id: Annotated[str, Path(max_length=64)]) -> Response:
    """The connection was revoked: stop injecting its token into any sandbox's request, at once."""
    if agent.egress is not None:
        agent.egress.revoke_connection(connection_id)
    return Response(status_code=204)


@router.get("/audit", response_model=AuditPage)
async def audit(agent: Agent, after: Annotated[int, Query(ge=0)] = 0,
                epoch: Annotated[str | None, Query(max_length=64)] = None,
                limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> AuditPage:
    if agent.egress is None:
        return AuditPage(epoch="none", items=[], last_seq=0, lost=0)
    # The cursor is what the control plane has stored: the node's (durable) buffer may let it go.
    agent.egress.audit.acknowledge(epoch, after)
    page = agent.egress.audit.read(after, epoch, limit)
    items = [AuditEvent.model_validate({"seq": seq, **ev.model_dump()}) for seq, ev in page.events]
    return AuditPage(epoch=page.epoch, last_seq=page.last_seq, lost=page.lost, dropped=page.dropped,
                     items=items)

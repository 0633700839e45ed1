"""Templates on this node and the warm pool of sandboxes restored from them."""

from __future__ import annotations

from fastapi import APIRouter, Response

from capsa.common.node_api import PoolStatus, TemplateList
from capsa.node.api.deps import Agent

__all__ = ["router"]

router = APIRouter(tags=["templates"])


@router.get("/templates", response_model=TemplateList)
async def list_templates(agent: Agent) -> TemplateList:
    return TemplateList.model_validate({"items": agent.list_templates()})


@router.get("/templates/{name}", response_model=TemplateList)
async def get_template(agent: Agent, name: str) -> TemplateList:
    return TemplateList.model_validate({"items": [t.as_dict() for t in agent.get_template(name)]})


@router.delete("/templates/{name}", status_code=204, response_class=Response)
async def delete_template(agent: Agent, name: str) -> Response:
    await agent.delete_template(name)
    return Response(status_code=204)


@router.get("/pool", response_model=PoolStatus)
async def pool(agent: Agent) -> PoolStatus:
    return PoolStatus.model_validate({"templates": agent.pool_status()})

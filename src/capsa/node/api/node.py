"""The node itself: ``/health`` (no token), ``/info``, and the Prometheus ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from capsa.common.node_api import NodeHealth, NodeInfo
from capsa.node.api.deps import Agent

__all__ = ["metrics", "public", "router"]

public = APIRouter()
router = APIRouter()
metrics = APIRouter()


@public.get("/health", response_model=NodeHealth)
async def health(agent: Agent) -> NodeHealth:
    return NodeHealth(status="ok", node_id=agent.node_id)


@router.get("/info", response_model=NodeInfo)
async def info(agent: Agent) -> NodeInfo:
    return NodeInfo.model_validate(agent.info())


@metrics.get("/metrics", response_class=Response)
async def prometheus(agent: Agent) -> Response:
    return Response(generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_LATEST)

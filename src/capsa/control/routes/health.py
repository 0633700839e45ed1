"""``/v1/health`` (liveness) and ``/v1/ready`` (database reachable and at least one healthy node)."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter, Request
from sqlalchemy import text

from capsa.control.deps import Plane, problems
from capsa.control.errors import ApiError
from capsa.control.nodes.placement import healthy_nodes
from capsa.control.schemas import Health, Ready

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health)
async def health() -> Health:
    return Health(status="ok", version=version("capsa"))


@router.get("/ready", response_model=Ready, responses={503: problems(503)[503]})
async def ready(plane: Plane, request: Request) -> Ready:
    # An embedding process (capsa serve) holds readiness until its local node has (re-)registered:
    # before that, the database may still list the node as healthy from the previous run.
    if getattr(request.app.state, "startup_pending", False):
        raise ApiError("starting: the local node is not ready (base template) or registered yet",
                       code="not_ready", status=503)
    try:
        async with plane.db() as db:
            await db.execute(text("SELECT 1"))
            nodes = await healthy_nodes(db, plane.settings.node_heartbeat_timeout)
    except Exception as exc:
        raise ApiError("database unavailable", code="not_ready", status=503) from exc
    if not nodes:
        raise ApiError("no healthy node", code="not_ready", status=503)
    return Ready(status="ready")

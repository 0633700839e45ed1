"""``GET /metrics``: the replica's Prometheus exposition (:mod:`capsa.control.metrics`).

Outside ``/v1`` (where scrapers look) but not public: the figures name nodes and count every tenant's
sessions, so it takes the metrics token (``CAPSA_METRICS_TOKEN``, what a ServiceMonitor sends as its bearer
token) or an admin API key; anything else is answered 401 (403 for a tenant's key) like every route.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from capsa.control.deps import Plane, Scraper, problems
from capsa.control.metrics import read_fleet

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text exposition",
          "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **problems(403)})
async def prometheus(plane: Plane, _scraper: Scraper) -> Response:
    async with plane.db() as db:
        figures = await read_fleet(db, plane.settings.node_heartbeat_timeout)
    return Response(plane.metrics.render(figures), media_type=CONTENT_TYPE_LATEST)

"""Node API routes for snapshots, templates and the warm pool (docs/node-snapshots.md).

Added to the app built by :func:`capsa.node.api.create_node_app` (which supplies the error handlers) with
:func:`add_snapshot_routes`, for a node whose agent is a :class:`SnapshotNodeAgent`.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from capsa.common.errors import CapsaError
from capsa.node.snapshot_agent import SnapshotNodeAgent

__all__ = [
    "BranchIn",
    "PauseIn",
    "PoolStatusOut",
    "RestoreIn",
    "SnapshotIn",
    "SnapshotListOut",
    "SnapshotOut",
    "SnapshotSandboxListOut",
    "SnapshotSandboxOut",
    "TemplateListOut",
    "TemplateOut",
    "add_snapshot_routes",
]

_bearer = HTTPBearer(auto_error=False)
_SbxId = Annotated[str, Field(pattern=r"^sbx_[0-9a-z]{20}$")]
_Env = Annotated[dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=4096)]],
                 Field(max_length=256)]
_Labels = Annotated[dict[Annotated[str, Field(min_length=1, max_length=64)],
                         Annotated[str, Field(max_length=256)]], Field(max_length=32)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SnapshotIn(_Strict):
    retain: bool = False
    labels: _Labels = Field(default_factory=dict)


class PauseIn(_Strict):
    labels: _Labels = Field(default_factory=dict)


class RestoreIn(_Strict):
    id: _SbxId
    env: _Env = Field(default_factory=dict)


class BranchIn(_Strict):
    # The count is checked by the agent (invalid_branch_count), so 0 or 10 000 ids get that code.
    ids: Annotated[list[str], Field(max_length=100_000)]
    env: _Env = Field(default_factory=dict)


class SnapshotOut(BaseModel):
    id: str
    sandbox_id: str | None
    retain: bool
    template: str | None
    created_at: str
    parent: str | None
    memory_mib: int
    vcpus: int
    image_digest: str
    size_bytes: int
    labels: dict[str, str]


class SnapshotListOut(BaseModel):
    items: list[SnapshotOut]


class SnapshotSandboxOut(BaseModel):
    id: str
    template: str
    memory_mib: int
    vcpus: int
    state: str
    failure: str | None
    accelerator: str
    created_at: float
    source: str
    snapshot: str | None
    create_ms: float | None


class SnapshotSandboxListOut(BaseModel):
    items: list[SnapshotSandboxOut]


class TemplateOut(BaseModel):
    name: str
    digest: str
    snapshot: str
    memory_mib: int
    vcpus: int
    image_digest: str
    created_at: str
    spec: dict[str, Any] | None
    size_bytes: int


class TemplateListOut(BaseModel):
    items: list[TemplateOut]


class PoolEntryOut(BaseModel):
    template: str
    memory_mib: int
    vcpus: int
    target: int
    idle: int
    restoring: int
    hits: int
    misses: int
    refill_failures: int


class PoolStatusOut(BaseModel):
    templates: list[PoolEntryOut]


def add_snapshot_routes(app: FastAPI, agent: SnapshotNodeAgent, token: str) -> None:
    """Mount the snapshot, template and pool routes and ``/metrics`` (all need the node token)."""

    async def _auth(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        given = credentials.credentials if credentials else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise CapsaError("missing or wrong node token", code="unauthorized", status=401)

    router = APIRouter(prefix="/node/v1", dependencies=[Depends(_auth)])

    @router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotOut)
    async def take_snapshot(sandbox_id: str, body: SnapshotIn) -> Any:
        return await agent.snapshot(sandbox_id, retain=body.retain, labels=body.labels)

    @router.get("/sandboxes/{sandbox_id}/snapshots", response_model=SnapshotListOut)
    async def sandbox_snapshots(sandbox_id: str) -> Any:
        return {"items": agent.list_snapshots(sandbox_id)}

    @router.post("/sandboxes/{sandbox_id}/pause", response_model=SnapshotOut)
    async def pause(sandbox_id: str, body: PauseIn) -> Any:
        return await agent.pause(sandbox_id, labels=body.labels)

    @router.post("/snapshots/{snapshot_id}/restore", status_code=201, response_model=SnapshotSandboxOut)
    async def restore(snapshot_id: str, body: RestoreIn) -> Any:
        return (await agent.restore(snapshot_id, body.id, body.env)).as_dict()

    @router.post("/snapshots/{snapshot_id}/branch", status_code=201, response_model=SnapshotSandboxListOut)
    async def branch(snapshot_id: str, body: BranchIn) -> Any:
        records = await agent.branch(snapshot_id, body.ids, body.env)
        return {"items": [r.as_dict() for r in records]}

    @router.get("/snapshots", response_model=SnapshotListOut)
    async def list_snapshots() -> Any:
        return {"items": agent.list_snapshots()}

    @router.get("/snapshots/{snapshot_id}", response_model=SnapshotOut)
    async def get_snapshot(snapshot_id: str) -> Any:
        return agent.get_snapshot(snapshot_id)

    @router.delete("/snapshots/{snapshot_id}", status_code=204, response_class=Response)
    async def delete_snapshot(snapshot_id: str) -> Response:
        agent.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    @router.get("/templates", response_model=TemplateListOut)
    async def list_templates() -> Any:
        return {"items": agent.list_templates()}

    @router.get("/templates/{name}", response_model=TemplateListOut)
    async def get_template(name: str) -> Any:
        return {"items": [t.as_dict() for t in agent.get_template(name)]}

    @router.delete("/templates/{name}", status_code=204, response_class=Response)
    async def delete_template(name: str) -> Response:
        await agent.delete_template(name)
        return Response(status_code=204)

    @router.get("/pool", response_model=PoolStatusOut)
    async def pool() -> Any:
        return {"templates": agent.pool_status()}

    app.include_router(router)

    @app.get("/metrics", dependencies=[Depends(_auth)], response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_LATEST)

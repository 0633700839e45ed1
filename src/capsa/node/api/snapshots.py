"""Snapshots (docs/node-snapshots.md): take, pause, list, get, delete, restore and branch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Response
from pydantic import SecretStr

from capsa.common.egress_policy import EgressPolicy
from capsa.common.node_api import (
    BranchRequest,
    PauseRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxList,
    SnapshotCreate,
    SnapshotInfo,
    SnapshotList,
)
from capsa.node.api.deps import Agent
from capsa.node.api.sandboxes import sandbox_info
from capsa.node.egress.node_egress import EgressRequest

__all__ = ["router"]

router = APIRouter(tags=["snapshots"])


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo)
async def take_snapshot(agent: Agent, sandbox_id: str, body: SnapshotCreate) -> SnapshotInfo:
    snap = await agent.snapshot(sandbox_id, retain=body.retain, labels=body.labels, tenant=body.tenant)
    return SnapshotInfo.model_validate(snap)


@router.get("/sandboxes/{sandbox_id}/snapshots", response_model=SnapshotList)
async def sandbox_snapshots(agent: Agent, sandbox_id: str) -> SnapshotList:
    return SnapshotList.model_validate({"items": agent.list_snapshots(sandbox_id)})


@router.post("/sandboxes/{sandbox_id}/pause", response_model=SnapshotInfo)
async def pause(agent: Agent, sandbox_id: str, body: PauseRequest) -> SnapshotInfo:
    return SnapshotInfo.model_validate(await agent.pause(sandbox_id, labels=body.labels, tenant=body.tenant))


def _egress(policy: dict[str, Any] | None, secrets: Mapping[str, SecretStr], placeholders: Mapping[str, str],
            session_id: str | None, networks: Sequence[object] = ()) -> EgressRequest | None:
    if policy is None:
        return None
    values = {k: v.get_secret_value() for k, v in secrets.items()}
    return EgressRequest(EgressPolicy.from_data(policy), values, dict(placeholders), session_id,
                         tuple(str(n) for n in networks))


@router.post("/snapshots/{snapshot_id}/restore", status_code=201, response_model=SandboxInfo)
async def restore(agent: Agent, snapshot_id: str, body: RestoreRequest) -> SandboxInfo:
    egress = _egress(body.policy, body.secrets, body.placeholders, body.session_id, body.granted_networks)
    return sandbox_info(await agent.restore(snapshot_id, body.id, body.env, egress=egress))


@router.post("/snapshots/{snapshot_id}/branch", status_code=201, response_model=SandboxList)
async def branch(agent: Agent, snapshot_id: str, body: BranchRequest) -> SandboxList:
    egress = None
    if body.egress is not None:
        egress = [r for r in (_egress(e.policy, e.secrets, e.placeholders, e.session_id, e.granted_networks)
                              for e in body.egress) if r is not None]
    records = await agent.branch(snapshot_id, body.ids, body.env, egress=egress)
    return SandboxList(items=[sandbox_info(r) for r in records])


@router.get("/snapshots", response_model=SnapshotList)
async def list_snapshots(agent: Agent) -> SnapshotList:
    return SnapshotList.model_validate({"items": agent.list_snapshots()})


@router.get("/snapshots/{snapshot_id}", response_model=SnapshotInfo)
async def get_snapshot(agent: Agent, snapshot_id: str) -> SnapshotInfo:
    return SnapshotInfo.model_validate(agent.get_snapshot(snapshot_id))


@router.delete("/snapshots/{snapshot_id}", status_code=204, response_class=Response)
async def delete_snapshot(agent: Agent, snapshot_id: str) -> Response:
    await agent.delete_snapshot(snapshot_id)
    return Response(status_code=204)

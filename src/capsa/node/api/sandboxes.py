"""``/sandboxes``: create, list, get and destroy sandboxes."""

from __future__ import annotations

from fastapi import APIRouter, Response

from capsa.common.egress_policy import EgressPolicy
from capsa.common.node_api import SandboxCreate, SandboxInfo, SandboxList
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.sandboxes import SandboxRecord
from capsa.node.api.deps import Agent

__all__ = ["create_from", "router", "sandbox_info"]

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])


def sandbox_info(record: SandboxRecord) -> SandboxInfo:
    return SandboxInfo.model_validate(record.as_dict())


async def create_from(agent: NodeAgent, body: SandboxCreate) -> SandboxInfo:
    """What ``POST /sandboxes`` does with a valid body (also called in-process by ``capsa serve``)."""
    policy = EgressPolicy.from_data(body.policy) if body.policy is not None else None
    record = await agent.create(body.id, body.template, body.memory_mib, body.vcpus, body.env, policy=policy,
                                session_id=body.session_id, placeholders=body.placeholders,
                                networks=[str(n) for n in body.granted_networks], tenant=body.tenant,
                                secrets={k: v.get_secret_value() for k, v in body.secrets.items()})
    return sandbox_info(record)


@router.post("", status_code=201, response_model=SandboxInfo)
async def create_sandbox(agent: Agent, body: SandboxCreate) -> SandboxInfo:
    return await create_from(agent, body)


@router.get("", response_model=SandboxList)
async def list_sandboxes(agent: Agent) -> SandboxList:
    return SandboxList(items=[sandbox_info(r) for r in agent.list()])


@router.get("/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(agent: Agent, sandbox_id: str) -> SandboxInfo:
    return sandbox_info(agent.get(sandbox_id))


@router.delete("/{sandbox_id}", status_code=204, response_class=Response)
async def destroy_sandbox(agent: Agent, sandbox_id: str) -> Response:
    await agent.destroy(sandbox_id)
    return Response(status_code=204)

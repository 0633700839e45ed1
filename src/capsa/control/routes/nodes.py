"""``/v1/nodes`` (admin only, except heartbeats, which a node may send with its own token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from capsa.control import nodes
from capsa.control.auth import authenticate, require_admin
from capsa.control.deps import Admin, Plane, problems
from capsa.control.errors import Unauthorized
from capsa.control.schemas import HeartbeatOut, NodeHeartbeat, NodeList, NodeOut, NodeRegister

__all__ = ["router"]

router = APIRouter(prefix="/nodes", tags=["nodes"], responses=problems(403, 404))
_bearer = HTTPBearer(auto_error=False, description="An admin API key, or the node's own token")


@router.post("", status_code=201, response_model=NodeOut)
async def register_node(body: NodeRegister, plane: Plane, _admin: Admin) -> NodeOut:
    return await nodes.register_node(plane, body)


@router.post("/{node_id}/heartbeat", response_model=HeartbeatOut)
async def node_heartbeat(node_id: str, body: NodeHeartbeat, plane: Plane,
                         credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                         ) -> HeartbeatOut:
    token = credentials.credentials if credentials else None
    if token and token.startswith("csk_"):
        async with plane.db() as db:
            require_admin(await authenticate(db, token))
    elif token:
        await nodes.check_node_token(plane, node_id, token)
    else:
        raise Unauthorized()
    return await nodes.heartbeat(plane, node_id, body)


@router.get("", response_model=NodeList)
async def list_nodes(plane: Plane, _admin: Admin) -> NodeList:
    return NodeList(items=await nodes.list_nodes(plane))

"""``/v1/nodes``: admin routes (list, register by hand, enrolment tokens, drain), a node's own routes
(register, heartbeat, leave; its credential or an admin key) and enrolment (a one-time token)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Body, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from capsa.common.connection_wire import ConnectionTokenOut, ConnectionTokenRequest
from capsa.control.auth import authenticate, require_admin
from capsa.control.connections import tokens as connection_tokens
from capsa.control.deps import Admin, Plane, problems
from capsa.control.errors import Unauthorized
from capsa.control.nodes import drain
from capsa.control.nodes import registry as nodes
from capsa.control.schemas import (
    DrainOut,
    HeartbeatOut,
    NodeCreate,
    NodeEnrol,
    NodeEnrolled,
    NodeHeartbeat,
    NodeList,
    NodeOut,
    NodeRegister,
    NodeToken,
    NodeTokenCreate,
    NodeUpdate,
)

__all__ = ["router"]

router = APIRouter(prefix="/nodes", tags=["nodes"], responses=problems(403, 404))
_node_bearer = HTTPBearer(auto_error=False, description="The node's credential, or an admin API key")
_enrol_bearer = HTTPBearer(auto_error=False, description="A one-time node enrolment token")
_NodeAuth = Annotated[HTTPAuthorizationCredentials | None, Depends(_node_bearer)]


async def _node_or_admin(node_id: str, plane: Plane, credentials: _NodeAuth) -> bool:
    """True: an admin key; False: the node's own credential."""
    token = credentials.credentials if credentials else None
    if token and token.startswith("csk_"):
        async with plane.db() as db:
            require_admin(await authenticate(db, token))
        return True
    if token:
        await nodes.check_node_credential(plane, node_id, token)
        return False
    raise Unauthorized()


_Node = Annotated[bool, Depends(_node_or_admin)]


@router.post("", status_code=201, response_model=NodeOut)
async def create_node(body: NodeCreate, plane: Plane, _admin: Admin) -> NodeOut:
    """Register a node by hand under an id the admin picks; its ``token`` is also its credential."""
    return await nodes.register_node(plane, body.id, body.registration(), credential=body.token)


@router.get("", response_model=NodeList)
async def list_nodes(plane: Plane, _admin: Admin) -> NodeList:
    return NodeList(items=await nodes.list_nodes(plane))


@router.post("/tokens", status_code=201, response_model=NodeToken)
async def create_enrol_token(plane: Plane, _admin: Admin,
                             body: Annotated[NodeTokenCreate | None, Body()] = None) -> NodeToken:
    """A one-time token for ``capsa node --enrol-token``, valid ``ttl_seconds``, used up by one enrolment."""
    return await nodes.create_enrol_token(plane, body or NodeTokenCreate())


@router.post("/enrol", status_code=201, response_model=NodeEnrolled, responses=problems(503))
async def enrol_node(body: NodeEnrol, plane: Plane,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_enrol_bearer)],
                     ) -> NodeEnrolled:
    """Create a node; the answer holds its credential, shown once (code ``enrol_token_invalid`` if the
    token is unknown, expired or used)."""
    return await nodes.enrol_node(plane, credentials.credentials if credentials else None, body)


@router.post("/{node_id}/register", response_model=NodeOut, responses=problems(503))
async def register_node(node_id: str, body: NodeRegister, plane: Plane, admin: _Node) -> NodeOut:
    """A restarted node announces its new address, API token and capacity; sessions that ran there lose
    their sandbox (paused at their latest snapshot, or failed). With the node's credential the capacity
    is bounded by its ``capacity_limit``; with an admin key it becomes the limit."""
    return await nodes.register_node(plane, node_id, body, set_limit=admin)


@router.patch("/{node_id}", response_model=NodeOut)
async def update_node(node_id: str, body: NodeUpdate, plane: Plane, _admin: Admin) -> NodeOut:
    """Set a node's ``capacity_limit``: the most its own reports may claim (a leaked node credential
    cannot make the node attract every new session)."""
    return await nodes.update_node(plane, node_id, body)


@router.post("/{node_id}/drain", response_model=DrainOut)
async def drain_node(node_id: str, plane: Plane, _admin: Admin) -> DrainOut:
    """Stop placing sandboxes on the node and move each of its running sessions to another node with its
    memory, processes and files (through the fleet's store). Answers once every session moved or was left
    paused (``stayed``, with the reason); ``drained``: nothing holds a sandbox on the node any more. A
    client that goes away does not stop a drain half way (a session left between pause and resume)."""
    return await asyncio.shield(drain.drain_node(plane, node_id))


@router.post("/{node_id}/undrain", response_model=NodeOut)
async def undrain_node(node_id: str, plane: Plane, _admin: Admin) -> NodeOut:
    """Let a drained node take new sandboxes again."""
    return await drain.undrain_node(plane, node_id)


@router.post("/{node_id}/heartbeat", response_model=HeartbeatOut)
async def node_heartbeat(node_id: str, body: NodeHeartbeat, plane: Plane, _node: _Node) -> HeartbeatOut:
    return await nodes.heartbeat(plane, node_id, body)


@router.post("/{node_id}/leave", response_model=NodeOut)
async def leave_node(node_id: str, plane: Plane, _node: _Node) -> NodeOut:
    """The node is stopping: no new sessions go to it; its sessions are paused at their latest snapshot or
    failed now."""
    return await nodes.leave_node(plane, node_id)


@router.post("/{node_id}/connections/{connection_id}/token", response_model=ConnectionTokenOut,
             responses=problems(409, 503))
async def connection_token(node_id: str, connection_id: str, body: ConnectionTokenRequest, plane: Plane,
                           _node: _Node) -> ConnectionTokenOut:
    """A current access token of a connection that a live session on this node binds (refreshed here
    when due, once however many ask). Only for the node's own sessions; ``connection_revoked`` once it
    is revoked."""
    return await connection_tokens.token_for_node(plane, node_id, body.session_id, connection_id)

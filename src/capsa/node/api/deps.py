"""What every node route depends on: the node token (the one auth dependency) and the agent."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Query, Request, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from capsa.common.errors import CapsaError
from capsa.common.node_api import GUEST_PATH_PATTERN
from capsa.node.agent.agent import NodeAgent

__all__ = ["Agent", "GuestPath", "bearer_matches", "require_node_token", "websocket_authorized"]

_bearer = HTTPBearer(auto_error=False)


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <token>`` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def require_node_token(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """The Bearer token must be the node's (``app.state.node_token``, set by create_node_app)."""
    token: str = request.app.state.node_token
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise CapsaError("missing or wrong node token", code="unauthorized", status=401)


def websocket_authorized(websocket: WebSocket) -> bool:
    """The node token check for WebSocket routes (the dependency above reads HTTP requests only)."""
    token: str = websocket.app.state.node_token
    return bearer_matches(websocket.headers.get("authorization"), token)


async def _agent(request: Request) -> NodeAgent:
    # async: FastAPI runs a plain function dependency in its thread pool, a thread hand-off on every call
    agent = request.app.state.agent
    assert isinstance(agent, NodeAgent)
    return agent


Agent = Annotated[NodeAgent, Depends(_agent)]
GuestPath = Annotated[str, Query(min_length=1, max_length=4096, pattern=GUEST_PATH_PATTERN)]

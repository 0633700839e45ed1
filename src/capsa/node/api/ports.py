"""``/sandboxes/{id}/ports/{port}/tunnel``: a raw TCP connection to a port inside a sandbox (WebSocket).

Why a raw byte tunnel and not an HTTP proxy here: the node stays blind to what tenants speak on their
ports. The control plane needs raw bytes anyway for WebSocket upgrades (which an ASGI HTTP route cannot
hand over) and for ``capsa port-forward`` (any TCP protocol), and with one primitive it does HTTP itself
(h11 over this tunnel) in one place, next to the authentication and the ``expose`` list. The protocol
(status message, then BINARY messages, empty = half-close) is :mod:`capsa.common.port_tunnel`.

The node token is checked here, not by the router dependency the other routes share: that one reads an
HTTP request, and this route is a WebSocket.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, WebSocket

from capsa.common import ws_relay
from capsa.common.errors import CapsaError
from capsa.common.port_tunnel import OK_MESSAGE, problem_message
from capsa.node.agent.agent import NodeAgent
from capsa.node.api.deps import websocket_authorized
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.handles.tunnel import TcpTunnel
from capsa.node.statuses import status_of

__all__ = ["router"]

router = APIRouter(prefix="/sandboxes/{sandbox_id}/ports", tags=["ports"])

Port = Annotated[int, Path(ge=1, le=65535)]


@router.websocket("/{port}/tunnel")
async def tunnel(websocket: WebSocket, sandbox_id: str, port: Port) -> None:
    """Open a TCP connection to ``127.0.0.1:port`` in the sandbox and relay it (see the module doc)."""
    if not websocket_authorized(websocket):
        await websocket.close(code=1008, reason="missing or wrong node token")
        return
    agent = websocket.app.state.agent
    assert isinstance(agent, NodeAgent)
    await websocket.accept()
    try:
        tcp = await agent.guest(sandbox_id).open_port(port)
    except CapsaError as exc:
        await websocket.send_text(problem_message(status_of(exc), exc.code, exc.message))
        await websocket.close()
        return
    try:
        await websocket.send_text(OK_MESSAGE)
        await relay(websocket, tcp)
    finally:
        await tcp.close()


async def relay(websocket: WebSocket, tcp: TcpTunnel) -> None:
    """Bytes both ways until the port closes its side (then close 1000) or the client goes away; an empty
    BINARY message half-closes the port's side; a failure closes 1011."""

    async def to_port(data: bytes) -> None:
        if data:
            await tcp.write(data)
        else:
            await tcp.end()

    await ws_relay.relay(websocket, tcp.read(), on_bytes=to_port,
                         quiet=(GuestError, *ws_relay.QUIET_FAILURES), what=f"port tunnel to {tcp.port}")

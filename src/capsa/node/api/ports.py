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

import asyncio
import contextlib
import logging
from typing import Annotated

from fastapi import APIRouter, Path, WebSocket
from starlette.websockets import WebSocketDisconnect

from capsa.common.errors import CapsaError
from capsa.common.port_tunnel import OK_MESSAGE, problem_message
from capsa.node.agent import NodeAgent
from capsa.node.api.deps import websocket_authorized
from capsa.node.api.errors import status_of
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.handles.tunnel import TcpTunnel

__all__ = ["router"]

log = logging.getLogger(__name__)

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
    """Bytes both ways until the port closes its side (then close 1000) or the client goes away."""

    async def upstream() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                continue  # TEXT messages have no meaning after the status message
            if data:
                await tcp.write(data)
            else:
                await tcp.end()

    async def downstream() -> None:
        async for chunk in tcp.read():
            await websocket.send_bytes(chunk)

    up = asyncio.create_task(upstream())
    down = asyncio.create_task(downstream())
    try:
        done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        if down in done:
            exc = down.exception()
            code = 1000 if exc is None else 1011
            if exc is not None and not isinstance(exc, GuestError | WebSocketDisconnect | OSError):
                log.warning("port tunnel to %s failed: %r", tcp.port, exc)
            with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                await websocket.close(code=code)
        elif up.exception() is not None:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                await websocket.close(code=1011)
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

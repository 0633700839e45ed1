"""``/sandboxes/{id}/pty``: a pseudo-terminal in a sandbox over a WebSocket (capsa.common.terminal_wire).

The guest runs the command on a pty (``pty_open``); this route relays BINARY messages to and from it, turns
``resize``/``kill`` control messages into the guest's resize event and hang-up, and sends ``exit`` when
the command ended. The client closing the WebSocket hangs the terminal up: nothing stays behind in the
guest. Like the port tunnel, the route checks the node token itself.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from capsa.common import ws_relay
from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import (
    TerminalOptions,
    error_message,
    exit_message,
    follow_control,
    started_message,
)
from capsa.node.agent.agent import NodeAgent
from capsa.node.api.deps import websocket_authorized
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.handles.pty import PtyHandle
from capsa.node.statuses import status_of

__all__ = ["relay_terminal", "router"]

router = APIRouter(prefix="/sandboxes/{sandbox_id}", tags=["terminals"])


@router.websocket("/pty")
async def terminal(websocket: WebSocket, sandbox_id: str) -> None:
    """Query: cols, rows, cmd, cwd, user, env=NAME=VALUE (repeated). Messages: see the module doc."""
    agent = websocket.app.state.agent
    assert isinstance(agent, NodeAgent)
    await websocket.accept()
    try:
        if not websocket_authorized(websocket):
            raise CapsaError("missing or wrong node token", code="unauthorized", status=401)
        options = TerminalOptions.from_query(websocket.query_params.multi_items())
        pty = await agent.guest(sandbox_id).open_terminal(cols=options.cols, rows=options.rows,
                                                          cmd=options.cmd, env=options.env, cwd=options.cwd,
                                                          user=options.user)
    except CapsaError as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await websocket.send_text(error_message(status_of(exc), exc.code, exc.message))
            await websocket.close()
        return
    try:
        await websocket.send_text(started_message(pty.pid))
        await relay_terminal(websocket, pty)
    finally:
        await pty.close()


async def relay_terminal(websocket: WebSocket, pty: PtyHandle) -> None:
    """Input, resizes and hang-up from the client; output, then ``exit`` and close 1000, from the guest; a
    failure closes 1011 after an ``error`` message when it is a capsa error."""

    async def to_pty(data: bytes) -> None:
        if data:
            await pty.write(data)

    async def control(text: str) -> None:
        await follow_control(text, resize=pty.resize, kill=lambda: pty.send_signal(signal.SIGKILL))

    async def output() -> AsyncIterator[bytes | str]:
        async for chunk in pty.read():
            yield chunk
        if pty.exit_code is not None or pty.signal is not None:
            yield exit_message(pty.exit_code, pty.signal)

    def failure(exc: BaseException) -> str | None:
        return error_message(status_of(exc), exc.code, exc.message) if isinstance(exc, CapsaError) else None

    await ws_relay.relay(websocket, output(), on_bytes=to_pty, on_text=control, failure_text=failure,
                         quiet=(GuestError, *ws_relay.QUIET_FAILURES), what=f"terminal {pty.pid}")

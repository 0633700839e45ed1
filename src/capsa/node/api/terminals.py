"""``/sandboxes/{id}/pty``: a pseudo-terminal in a sandbox over a WebSocket (capsa.common.terminal_wire).

The guest runs the command on a pty (``pty_open``); this route relays BINARY messages to and from it, turns
``resize``/``kill`` control messages into the guest's resize event and hang-up, and sends ``exit`` when
the command ended. The client closing the WebSocket hangs the terminal up: nothing stays behind in the
guest. Like the port tunnel, the route checks the node token itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import (
    TerminalOptions,
    error_message,
    exit_message,
    parse_client_message,
    started_message,
)
from capsa.node.agent import NodeAgent
from capsa.node.api.deps import websocket_authorized
from capsa.node.api.errors import status_of
from capsa.node.guestlink.errors import GuestError
from capsa.node.guestlink.handles.pty import PtyHandle

__all__ = ["relay_terminal", "router"]

log = logging.getLogger(__name__)

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
    """Input, resizes and hang-up from the client; output, then ``exit`` and close 1000, from the guest."""

    async def upstream() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data:
                await pty.write(data)
                continue
            text = message.get("text")
            if text is None:
                continue
            kind, cols, rows = parse_client_message(text)
            if kind == "resize":
                await pty.resize(cols, rows)
            elif kind == "kill":
                await pty.send_signal(signal.SIGKILL)

    async def downstream() -> None:
        async for chunk in pty.read():
            await websocket.send_bytes(chunk)
        if pty.exit_code is not None or pty.signal is not None:
            await websocket.send_text(exit_message(pty.exit_code, pty.signal))

    up = asyncio.create_task(upstream())
    down = asyncio.create_task(downstream())
    try:
        done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        if down in done:
            exc = down.exception()
            if exc is not None and not isinstance(exc, GuestError | WebSocketDisconnect | OSError):
                log.warning("terminal %s failed: %r", pty.pid, exc)
            with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                if isinstance(exc, CapsaError):
                    await websocket.send_text(error_message(status_of(exc), exc.code, exc.message))
                await websocket.close(code=1000 if exc is None else 1011)
        elif up.exception() is not None:
            exc = up.exception()
            with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
                if isinstance(exc, CapsaError):
                    await websocket.send_text(error_message(status_of(exc), exc.code, exc.message))
                await websocket.close(code=1011)
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

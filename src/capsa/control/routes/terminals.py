"""``/v1/sessions/{id}/pty`` (WebSocket): a terminal in the session's sandbox (protocol:
:mod:`capsa.common.terminal_wire`; query ``cols``, ``rows``, ``cmd``, ``cwd``, ``user``, ``env=NAME=VALUE``).

Authenticated with the API key (``Authorization: Bearer``) like every route; another tenant's session is
404. Opening a terminal spends one unit of the key's command rate limit (``rate_limited``, answered on the
upgrade) and is chained at once as a ``command`` ``terminal`` event (the ``cmd`` line, or the login shell,
``cwd``, ``user``, ``env_keys``, ``pid``); how it ended (``terminal_exit``) is chained with the call's
``api`` event when the socket closes. Failures before the terminal runs (bad key 401, unknown session 404,
bad ``cols`` 422, session not running 409 ...) answer the upgrade with problem+json. Once accepted, the
control plane relays messages between the client and the node's terminal (:func:`relay`) and keeps the
session active.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from capsa.common import ws_relay
from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import (
    TerminalClient,
    TerminalOptions,
    error_message,
    exit_message,
    follow_control,
    started_message,
)
from capsa.control.audit import trail as audit_trail
from capsa.control.audit.trail import AuditEntry
from capsa.control.auth import authenticate, bearer_token
from capsa.control.plane import ControlPlane
from capsa.control.ports.access import keep_active
from capsa.control.problems import refuse_websocket
from capsa.control.routes.commands import argv_detail
from capsa.control.sessions.process_io import open_terminal

__all__ = ["relay", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/sessions/{session_id}", tags=["terminals"])


@router.websocket("/pty")
async def terminal(websocket: WebSocket, session_id: str) -> None:
    plane = websocket.app.state.plane
    assert isinstance(plane, ControlPlane)
    try:
        async with plane.db() as db:
            principal = await authenticate(db, bearer_token(websocket.headers.get("authorization")))
        options = TerminalOptions.from_query(websocket.query_params.multi_items())
        await plane.rates.hit(plane.db, principal.key_id, "commands", plane.settings.command_limit,
                              plane.settings.rate_window_seconds)
        term = await open_terminal(plane, principal.tenant, session_id, options)
    except CapsaError as exc:
        await refuse_websocket(websocket, exc)
        return
    _chain_start(plane, principal.tenant, session_id, options, term.pid)
    try:
        await websocket.accept()
        await websocket.send_text(started_message(term.pid))
        async with keep_active(plane, session_id):
            await relay(websocket, term)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        await term.close()
        ended = term.exit
        audit_trail.note("command", "terminal_exit", session_id=session_id, detail={
            "pid": term.pid, "exit_code": ended.exit_code if ended else None,
            "signal": ended.signal if ended else None})


def _chain_start(plane: ControlPlane, tenant: str, session_id: str, options: TerminalOptions,
                 pid: int) -> None:
    """The terminal's command goes into the chain now, not when the socket closes (hours later)."""
    context = audit_trail.current()
    detail = {**argv_detail(options.cmd if options.cmd is not None else "<login shell>"),
              "login_shell": options.cmd is None, "cwd": options.cwd, "user": options.user,
              "env_keys": sorted(options.env or {}), "pid": pid, "cols": options.cols, "rows": options.rows}
    entry = AuditEntry("command", "terminal", session_id=session_id, detail=detail,
                       key_id=context.key_id if context else None,
                       request_id=context.request_id if context else None)
    done = plane.audit.submit(tenant, [entry], urgent=True)
    done.add_done_callback(_log_failure)


def _log_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and (exc := done.exception()) is not None:
        log.error("could not chain a terminal's start", exc_info=exc)


async def relay(websocket: WebSocket, term: TerminalClient) -> None:
    """Client BINARY/resize/kill -> the node's terminal; its output, then ``exit`` and close 1000, back; a
    failure closes 1011 after an ``error`` message when it is a capsa error (others are logged)."""

    async def to_term(data: bytes) -> None:
        if data:  # an empty BINARY message carries nothing to type
            await term.send(data)

    async def control(text: str) -> None:
        await follow_control(text, resize=term.resize, kill=term.kill)

    async def output() -> AsyncIterator[bytes | str]:
        while (chunk := await term.recv()) is not None:
            yield chunk
        if term.exit is not None:
            yield exit_message(term.exit.exit_code, term.exit.signal)

    def failure(exc: BaseException) -> str | None:
        return error_message(exc.status, exc.code, exc.message) if isinstance(exc, CapsaError) else None

    await ws_relay.relay(websocket, output(), on_bytes=to_term, on_text=control, failure_text=failure,
                         quiet=(CapsaError, *ws_relay.QUIET_FAILURES), what="terminal relay")

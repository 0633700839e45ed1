"""Who may reach a session's port: the tenant's API key, or a per-session, per-port access token.

Tokens (``cpt_…``) are made by ``POST /v1/sessions/{id}/ports/{port}/tokens``, shown once and stored as
SHA-256; they are deleted when revoked and when the session ends (``sessions.finish_session``). A request
may carry a token as the ``token`` query parameter, the ``X-Capsa-Port-Token`` header or the
``capsa_port_token`` cookie (set by the first answer to a URL with a token, for that port's path only), so
a browser tab or a tool that cannot send the API key can open the port. A token that is unknown,
revoked, or made for another session or port answers 404, like another tenant's session. The session's
``expose`` list, when it has one, bounds the ports (``port_not_exposed``, 403), for keys and tokens alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from starlette.requests import HTTPConnection

from capsa.common.ids import new_id
from capsa.control import audit_trail
from capsa.control.auth import authenticate, bearer_token
from capsa.control.errors import ApiError, InvalidState, NotFound, Unauthorized
from capsa.control.keys import parse_key
from capsa.control.nodeclient import NodeClient
from capsa.control.plane import ControlPlane
from capsa.control.schemas import PortToken
from capsa.control.sessions import get_session, running_session
from capsa.control.store.models import PortTokenRow, SessionRow, utcnow

__all__ = ["ACTIVITY_INTERVAL", "TOKEN_COOKIE", "TOKEN_HEADER", "TOKEN_QUERY", "PortAccess", "PortNotExposed",
           "authorize", "check_exposed", "create_token", "keep_active", "port_path", "revoke_token"]

TOKEN_QUERY = "token"
TOKEN_HEADER = "x-capsa-port-token"
TOKEN_COOKIE = "capsa_port_token"
"""Set (path-scoped to the port) on an answer to a request that brought its token in the URL, so the
pages and assets a browser tab loads next are let in too."""
_TOKEN_PREFIX = "cpt_"


class PortNotExposed(ApiError):
    code, status, title = "port_not_exposed", 403, "Port not exposed"


ACTIVITY_INTERVAL = 30.0
"""Seconds between the activity marks of an open WebSocket or tunnel (for the session's idle timeout)."""


@contextlib.asynccontextmanager
async def keep_active(plane: ControlPlane, session_id: str) -> AsyncIterator[None]:
    """While the block runs (a WebSocket or tunnel into the session), the session counts as active: an
    open connection must not be cut by the idle timeout only because no new request came."""

    async def mark() -> None:
        while True:
            await asyncio.sleep(ACTIVITY_INTERVAL)
            async with plane.db() as db:
                await db.execute(update(SessionRow)
                                 .where(SessionRow.id == session_id, SessionRow.state == "running")
                                 .values(last_activity_at=utcnow()))
                await db.commit()

    task = asyncio.create_task(mark())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def port_path(session_id: str, port: int) -> str:
    return f"/v1/sessions/{session_id}/ports/{port}/"


def check_exposed(row: SessionRow, port: int) -> None:
    if row.expose is not None and port not in row.expose:
        raise PortNotExposed(f"session {row.id} exposes ports {row.expose}, not {port}")


@dataclass(frozen=True)
class PortAccess:
    row: SessionRow
    client: NodeClient
    used_api_key: bool
    """The request authenticated with the API key in Authorization (which must not reach the sandbox)."""
    query_token: str | None = None
    """The port token, when it came in the URL (the answer sets it as a cookie)."""


async def authorize(plane: ControlPlane, conn: HTTPConnection, session_id: str, port: int) -> PortAccess:
    """The running session whose ``port`` this request may reach, and a client for its node."""
    bearer = bearer_token(conn.headers.get("authorization"))
    in_query = conn.query_params.get(TOKEN_QUERY)
    token = in_query or conn.headers.get(TOKEN_HEADER) or conn.cookies.get(TOKEN_COOKIE)
    if bearer is not None and parse_key(bearer) is not None:
        async with plane.db() as db:
            principal = await authenticate(db, bearer)
        tenant, used_key = principal.tenant, True
    elif token:
        # An Authorization header that is not a capsa key belongs to the app in the sandbox: it is passed on.
        tenant, used_key = await _token_tenant(plane, token, session_id, port), False
    else:
        raise Unauthorized("an API key or a port token (?token= or X-Capsa-Port-Token) is required")
    row, client = await running_session(plane, tenant, session_id, fresh=True)
    check_exposed(row, port)
    return PortAccess(row, client, used_key, in_query if in_query and not used_key else None)


async def _token_tenant(plane: ControlPlane, token: str, session_id: str, port: int) -> str:
    if not token.startswith(_TOKEN_PREFIX) or len(token) > 128:
        raise NotFound(f"session {session_id} not found")
    async with plane.db() as db:
        found = (await db.execute(select(PortTokenRow).where(PortTokenRow.token_hash == _hash(token)))
                 ).scalar_one_or_none()
    if found is None or found.session_id != session_id or found.port != port:
        raise NotFound(f"session {session_id} not found")
    # Traffic on a token is chained like a key's: each request (a WebSocket: each connection) is an
    # ``api`` event of the token's tenant, its ``key_id`` the token's id.
    audit_trail.identify(found.tenant, found.id)
    return found.tenant


async def create_token(plane: ControlPlane, tenant: str, session_id: str, port: int,
                       base_url: str) -> PortToken:
    session = await get_session(plane, tenant, session_id)  # another tenant's: not_found
    if session.state not in ("creating", "running", "paused"):
        raise InvalidState(f"session {session_id} is {session.state}")
    if session.expose is not None and port not in session.expose:
        raise PortNotExposed(f"session {session_id} exposes ports {session.expose}, not {port}")
    token = _TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = PortTokenRow(id=new_id("ptk"), token_hash=_hash(token), tenant=tenant, session_id=session_id,
                       port=port, created_at=utcnow())
    async with plane.db() as db:
        db.add(row)
        await db.commit()
    url = f"{base_url.rstrip('/')}{port_path(session_id, port)}?{TOKEN_QUERY}={token}"
    return PortToken(id=row.id, session_id=session_id, port=port, token=token, url=url,
                     created_at=row.created_at)


async def revoke_token(plane: ControlPlane, tenant: str, session_id: str, port: int, token_id: str) -> None:
    await get_session(plane, tenant, session_id)
    async with plane.db() as db:
        result = await db.execute(delete(PortTokenRow).where(
            PortTokenRow.id == token_id, PortTokenRow.session_id == session_id, PortTokenRow.port == port,
            PortTokenRow.tenant == tenant))
        await db.commit()
    if not getattr(result, "rowcount", 0):
        raise NotFound(f"port token {token_id} not found")

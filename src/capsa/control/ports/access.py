"""Who may reach a session's port: the tenant's API key, or a per-session, per-port access token.

Tokens (``cpt_…``) are made by ``POST /v1/sessions/{id}/ports/{port}/tokens`` (and by ``GET …/browser`` for
its CDP and live-view URLs), shown once and stored as SHA-256. Each expires (``ttl_seconds``, default
``CAPSA_PORT_TOKEN_TTL``, a day; at most ``CAPSA_PORT_TOKEN_MAX_TTL``, a week); ``GET /v1/sessions/{id}/
port-tokens`` lists a session's tokens (never the secrets), ``DELETE …/port-tokens/{token_id}`` revokes any
of them; they are deleted when the session ends (``sessions.finish_session``). A request may carry a token
as the ``token`` query parameter, the ``X-Capsa-Port-Token`` header or the ``capsa_port_token`` cookie (set
by the first answer to a URL with a token, for that port's host or path only, until the token expires), so
a browser tab or a tool that cannot send the API key can open the port. A token that is unknown, expired,
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
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from starlette.requests import HTTPConnection

from capsa.common.ids import new_id
from capsa.control.audit import trail as audit_trail
from capsa.control.auth import authenticate, bearer_token
from capsa.control.errors import ApiError, InvalidState, NotFound, Unauthorized, ValidationFailed
from capsa.control.keys import parse_key
from capsa.control.plane import ControlPlane
from capsa.control.ports.hosts import on_port_host, port_base_url, port_path
from capsa.control.schemas import PortToken, PortTokenInfo
from capsa.control.sessions.relay import SessionTarget, running
from capsa.control.sessions.service import get_session
from capsa.control.store.models import PortTokenRow, SessionRow, utcnow

__all__ = ["ACTIVITY_INTERVAL", "TOKEN_COOKIE", "TOKEN_HEADER", "TOKEN_PREFIX", "TOKEN_QUERY", "PortAccess",
           "PortNotExposed", "authorize", "check_exposed", "create_token", "keep_active", "list_tokens",
           "port_path", "revoke_token"]

TOKEN_QUERY = "token"
TOKEN_HEADER = "x-capsa-port-token"
TOKEN_COOKIE = "capsa_port_token"
"""Set (path-scoped to the port) on an answer to a request that brought its token in the URL, so the
pages and assets a browser tab loads next are let in too."""
TOKEN_PREFIX = "cpt_"


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


def check_exposed(row: SessionRow, port: int) -> None:
    if row.expose is not None and port not in row.expose:
        raise PortNotExposed(f"session {row.id} exposes ports {row.expose}, not {port}")


@dataclass(frozen=True)
class PortAccess:
    target: SessionTarget
    """The running session, for the relay's calls."""
    used_api_key: bool
    """The request authenticated with the API key in Authorization (which must not reach the sandbox)."""
    query_token: str | None = None
    """The port token, when it came in the URL (the answer sets it as a cookie)."""
    token_expires_at: datetime | None = None
    """When that token expires (the cookie's lifetime)."""
    on_host: bool = False
    """The request came to the port's own host (``CAPSA_PORTS_DOMAIN``), not to the API's path route."""


async def authorize(plane: ControlPlane, conn: HTTPConnection, session_id: str, port: int) -> PortAccess:
    """The running session whose ``port`` this request may reach, and a client for its node."""
    bearer = bearer_token(conn.headers.get("authorization"))
    in_query = conn.query_params.get(TOKEN_QUERY)
    token = in_query or conn.headers.get(TOKEN_HEADER) or conn.cookies.get(TOKEN_COOKIE)
    expires_at = None
    if bearer is not None and parse_key(bearer) is not None:
        async with plane.db() as db:
            principal = await authenticate(db, bearer)
        tenant, used_key = principal.tenant, True
    elif token:
        # An Authorization header that is not a capsa key belongs to the app in the sandbox: it is passed on.
        found = await _token_row(plane, token, session_id, port)
        tenant, used_key, expires_at = found.tenant, False, found.expires_at
        # Traffic on a token is chained like a key's: each request (a WebSocket: each connection) is an
        # ``api`` event of the token's tenant, its ``key_id`` the token's id.
        audit_trail.identify(found.tenant, found.id)
    else:
        raise Unauthorized("an API key or a port token (?token= or X-Capsa-Port-Token) is required")
    target = await running(plane, tenant, session_id, fresh=True)
    check_exposed(target.row, port)
    return PortAccess(target, used_key, in_query if in_query and not used_key else None,
                      expires_at, on_port_host(conn))


async def _token_row(plane: ControlPlane, token: str, session_id: str, port: int) -> PortTokenRow:
    if not token.startswith(TOKEN_PREFIX) or len(token) > 128:
        raise NotFound(f"session {session_id} not found")
    async with plane.db() as db:
        found = (await db.execute(select(PortTokenRow).where(PortTokenRow.token_hash == _hash(token)))
                 ).scalar_one_or_none()
    if found is None or found.session_id != session_id or found.port != port or found.expires_at <= utcnow():
        raise NotFound(f"session {session_id} not found")
    return found


def _ttl(plane: ControlPlane, ttl_seconds: int | None) -> int:
    settings = plane.settings
    if ttl_seconds is None:
        return min(settings.port_token_ttl, settings.port_token_max_ttl)
    ttl = ttl_seconds
    if not 60 <= ttl <= settings.port_token_max_ttl:
        raise ValidationFailed(f"ttl_seconds must be between 60 and {settings.port_token_max_ttl}",
                               [{"loc": "body.ttl_seconds", "msg": "out of range"}])
    return ttl


async def create_token(plane: ControlPlane, tenant: str, session_id: str, port: int,
                       base_url: str, ttl_seconds: int | None = None) -> PortToken:
    """A new token for ``port`` of the session; its ``url`` is the port's own host when the API has a
    ports domain, else the path route under ``base_url`` (the API's public URL)."""
    ttl = _ttl(plane, ttl_seconds)
    session = await get_session(plane, tenant, session_id)  # another tenant's: not_found
    if session.state not in ("creating", "running", "recovering", "paused"):
        raise InvalidState(f"session {session_id} is {session.state}")
    if session.expose is not None and port not in session.expose:
        raise PortNotExposed(f"session {session_id} exposes ports {session.expose}, not {port}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    row = PortTokenRow(id=new_id("ptk"), token_hash=_hash(token), tenant=tenant, session_id=session_id,
                       port=port, created_at=now, expires_at=now + timedelta(seconds=ttl))
    async with plane.db() as db:
        await db.execute(delete(PortTokenRow).where(PortTokenRow.session_id == session_id,
                                                    PortTokenRow.expires_at <= now))
        db.add(row)
        await db.commit()
    url = f"{port_base_url(base_url, plane.settings.ports_domain, session_id, port)}?{TOKEN_QUERY}={token}"
    return PortToken(id=row.id, session_id=session_id, port=port, token=token, url=url,
                     created_at=row.created_at, expires_at=row.expires_at)


async def list_tokens(plane: ControlPlane, tenant: str, session_id: str) -> list[PortTokenInfo]:
    """The session's tokens that still work (any port, whoever made them), oldest first."""
    await get_session(plane, tenant, session_id)
    async with plane.db() as db:
        rows = (await db.execute(select(PortTokenRow).where(
            PortTokenRow.session_id == session_id, PortTokenRow.tenant == tenant,
            PortTokenRow.expires_at > utcnow()).order_by(PortTokenRow.created_at, PortTokenRow.id))).scalars()
        return [PortTokenInfo(id=r.id, session_id=r.session_id, port=r.port, created_at=r.created_at,
                              expires_at=r.expires_at) for r in rows]


async def revoke_token(plane: ControlPlane, tenant: str, session_id: str, port: int | None,
                       token_id: str) -> None:
    """Delete one token of the session (of ``port``, when given)."""
    await get_session(plane, tenant, session_id)
    where = [PortTokenRow.id == token_id, PortTokenRow.session_id == session_id,
             PortTokenRow.tenant == tenant]
    if port is not None:
        where.append(PortTokenRow.port == port)
    async with plane.db() as db:
        result = await db.execute(delete(PortTokenRow).where(*where))
        await db.commit()
    if not getattr(result, "rowcount", 0):
        raise NotFound(f"port token {token_id} not found")


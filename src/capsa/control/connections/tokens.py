"""Access tokens for nodes, and refresh, which happens here in the control plane only.

Why here and not on the nodes: the refresh token and the client secret then never leave the control
plane; providers that rotate refresh tokens (each refresh answers a new one and voids the old) would make
nodes that refresh on their own race each other and lose the sign-in; and one refresh per expiry serves
every node and session that binds the connection. Nodes fetch a current access token when theirs is due
(:func:`capsa.common.connection_wire.refresh_margin`, the same rule on both sides) and hold only that.

Single flight across replicas: a replica refreshes only after it took the connection's refresh lease (a
conditional ``UPDATE``); the others wait for the new token to appear in the row. Within a replica an
asyncio lock per connection keeps concurrent callers from even racing for the lease.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import or_, update

from capsa.common.connection_wire import ConnectionTokenOut, refresh_margin
from capsa.common.ids import is_id
from capsa.control.connections.oauth_client import ProviderError
from capsa.control.connections.store import find_connection, oauth_client, sealer, store_tokens
from capsa.control.errors import ApiError, Forbidden, NotFound, ValidationFailed
from capsa.control.plane import ControlPlane
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.store.connection_models import ConnectionProviderRow, ConnectionRow
from capsa.control.store.egress_models import SessionPolicyRow
from capsa.control.store.models import SessionRow

__all__ = ["current_token", "resolve_connections", "token_for_node"]

_LEASE = 30.0
_locks: dict[str, asyncio.Lock] = {}


class ConnectionRevoked(ApiError):
    code, status, title = "connection_revoked", 403, "Connection revoked"


class NotSignedIn(ApiError):
    code, status, title = "connection_not_signed_in", 409, "Connection not signed in"


async def resolve_connections(plane: ControlPlane, tenant: str, document: dict[str, Any]) -> None:
    """Turn the connection references (name or id) of a policy into the tenant's connection ids."""
    bindings = [dict(b) for b in document.get("connections", [])]
    if not bindings:
        return
    async with plane.db() as db:
        for binding in bindings:
            ref = str(binding["connection"])
            try:
                row = await find_connection(db, tenant, ref)
            except NotFound:
                raise ValidationFailed(f"connection {ref!r} not found", [
                    {"field": "body.policy.connections", "message": f"unknown connection {ref!r}"}]) from None
            if row.state == "revoked":
                raise ValidationFailed(f"connection {ref!r} is revoked", [
                    {"field": "body.policy.connections", "message": f"connection {ref!r} is revoked"}])
            binding["connection"] = row.id
    document["connections"] = bindings


def _answer(plane: ControlPlane, row: ConnectionRow, now: float) -> ConnectionTokenOut | None:
    """The row's token if it is fresh enough, else None."""
    if row.access_token is None or row.access_expires_at is None:
        return None
    lifetime = row.access_lifetime or 0.0
    left = row.access_expires_at - now
    if left <= refresh_margin(lifetime):
        return None
    token = sealer(plane).open(row.tenant, f"{row.id}/access", row.access_token)
    return ConnectionTokenOut(access_token=token, expires_in=left, lifetime=lifetime)


async def _load(plane: ControlPlane, connection_id: str) -> ConnectionRow:
    async with plane.db() as db:
        row = await db.get(ConnectionRow, connection_id, populate_existing=True)
    if row is None:
        raise NotFound(f"connection {connection_id} not found")
    if row.state == "revoked":
        raise ConnectionRevoked(f"connection {connection_id} was revoked")
    if row.state != "active" or (row.refresh_token is None and row.access_token is None):
        raise NotSignedIn(f"nobody has signed in to connection {connection_id} yet")
    return row


async def _take_lease(plane: ControlPlane, connection_id: str, now: float) -> bool:
    async with plane.db() as db:
        result = await db.execute(update(ConnectionRow).where(
            ConnectionRow.id == connection_id, ConnectionRow.state == "active",
            or_(ConnectionRow.refresh_lease_until.is_(None), ConnectionRow.refresh_lease_until < now))
            .values(refresh_lease_until=now + _LEASE))
        await db.commit()
    return bool(getattr(result, "rowcount", 0) == 1)


async def _refresh(plane: ControlPlane, connection_id: str) -> ConnectionTokenOut:
    async with plane.db() as db:
        row = await db.get(ConnectionRow, connection_id, populate_existing=True)
        assert row is not None
        provider = await db.get(ConnectionProviderRow, row.provider_id)
        assert provider is not None
        try:
            if row.refresh_token is None:
                raise NotSignedIn(f"connection {connection_id} has no refresh token; sign in again")
            refresh = sealer(plane).open(row.tenant, f"{row.id}/refresh", row.refresh_token)
            tokens = await oauth_client(plane, provider, row.scopes).refresh(refresh)
        except ProviderError as exc:
            if exc.error == "invalid_grant":  # the sign-in ended at the provider: a person must sign in again
                row.state, row.refresh_token, row.access_token = "pending", None, None
            row.refresh_lease_until = None
            await db.commit()
            raise NotSignedIn(f"the provider refused to refresh connection {connection_id}: {exc.error}") \
                from None
        except BaseException:
            row.refresh_lease_until = None
            await db.commit()
            raise
        fresh = await db.get(ConnectionRow, connection_id, populate_existing=True)
        if fresh is None or fresh.state != "active":
            raise ConnectionRevoked(f"connection {connection_id} was revoked")
        store_tokens(plane, row, tokens)
        row.refreshes += 1
        row.refresh_lease_until = None
        await db.commit()
    return ConnectionTokenOut(access_token=tokens.access_token, expires_in=tokens.expires_at - time.time(),
                              lifetime=tokens.lifetime)


async def current_token(plane: ControlPlane, connection_id: str, *, wait: float = 30.0) -> ConnectionTokenOut:
    """A token valid beyond its refresh margin: the stored one, or a new one from exactly one refresh."""
    lock = _locks.setdefault(connection_id, asyncio.Lock())
    async with lock:
        deadline = time.monotonic() + wait
        while True:
            now = time.time()
            row = await _load(plane, connection_id)
            answer = _answer(plane, row, now)
            if answer is not None:
                return answer
            if await _take_lease(plane, connection_id, now):
                return await _refresh(plane, connection_id)
            if time.monotonic() > deadline:
                raise ApiError(f"connection {connection_id} is being refreshed elsewhere; try again",
                               code="connection_busy", status=503)
            await asyncio.sleep(0.1)  # another replica holds the lease: its token lands in the row


async def token_for_node(plane: ControlPlane, node_id: str, session_id: str,
                         connection_id: str) -> ConnectionTokenOut:
    """What a node asks for: only for a live session placed on it whose policy binds the connection."""
    if not is_id(session_id, "ses") or not is_id(connection_id, "con"):
        raise NotFound("no such session or connection")
    async with plane.db() as db:
        session = await db.get(SessionRow, session_id, populate_existing=True)
        policy = await db.get(SessionPolicyRow, session_id, populate_existing=True)
        connection = await db.get(ConnectionRow, connection_id, populate_existing=True)
    if session is None or session.node_id != node_id or session.state not in ACTIVE_STATES:
        raise Forbidden(f"session {session_id} does not run on node {node_id}")
    bound = any(c.get("connection") == connection_id for c in (policy.policy if policy else {})
                .get("connections", []))
    if not bound or connection is None or connection.tenant != session.tenant:
        raise Forbidden(f"session {session_id} does not bind connection {connection_id}")
    return await current_token(plane, connection_id)

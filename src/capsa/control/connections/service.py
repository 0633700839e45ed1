"""Connections: providers a tenant registers, connections (a person's OAuth 2.0 sign-in), the sign-in
itself (authorization code with PKCE through ``/v1/connections/callback``, or the device grant) and
revocation (nodes first, so injection stops at once, then the provider's revocation endpoint).

Tokens for the broker (and refresh) are in :mod:`capsa.control.connections.tokens`.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update

from capsa.common.ids import new_id
from capsa.common.wire.connections import (
    ConnectionList,
    ConnectionOut,
    LoginOut,
    LoginPollOut,
    ProviderList,
    ProviderOut,
    RevokeOut,
)
from capsa.control.connections.oauth_client import ProviderError, discover
from capsa.control.connections.schemas import ConnectionCreate, ProviderCreate
from capsa.control.connections.store import (
    connection_out,
    find_connection,
    find_provider,
    oauth_client,
    outbound,
    provider_out,
    sealer,
    store_tokens,
)
from capsa.control.errors import ApiError, InvalidState
from capsa.control.nodes.calls import quietly
from capsa.control.plane import ControlPlane
from capsa.control.sessions.states import ACTIVE_STATES
from capsa.control.store.connection_models import ConnectionLoginRow, ConnectionProviderRow, ConnectionRow
from capsa.control.store.egress_models import SessionPolicyRow
from capsa.control.store.models import NodeRow, SessionRow, utcnow
from capsa.control.store.named import add_named, list_named

__all__ = [
    "CALLBACK_PATH",
    "complete_code_login",
    "create_connection",
    "create_provider",
    "delete_provider",
    "get_connection",
    "list_connections",
    "list_providers",
    "poll_device_login",
    "revoke_connection",
    "start_login",
]

log = logging.getLogger(__name__)

CALLBACK_PATH = "/v1/connections/callback"


class LoginStateInvalid(ApiError):
    code, status, title = "login_state_invalid", 400, "Sign-in state invalid"


def _state_key(state: str) -> str:
    return hashlib.sha256(state.encode()).hexdigest()


# -- providers -------------------------------------------------------------------------------------------

async def create_provider(plane: ControlPlane, tenant: str, body: ProviderCreate) -> ProviderOut:
    box = sealer(plane)
    where = outbound(plane)
    given = {"authorization_endpoint": body.authorization_endpoint, "token_endpoint": body.token_endpoint,
             "revocation_endpoint": body.revocation_endpoint,
             "device_authorization_endpoint": body.device_authorization_endpoint}
    for name, url in given.items():
        if url is not None:
            await where.check(name, url)
    found: dict[str, Any] = {}
    if body.issuer is not None:
        ca = str(plane.settings.oauth_ca_file) if plane.settings.oauth_ca_file else None
        found = await discover(body.issuer, outbound=where, ca_file=ca)
    token_endpoint = body.token_endpoint or found.get("token_endpoint")
    if not token_endpoint:
        raise ApiError("the provider has no token endpoint", code="provider_incomplete", status=422)
    provider_id = new_id("prv")
    row = ConnectionProviderRow(
        id=provider_id, tenant=tenant, name=body.name, issuer=body.issuer,
        authorization_endpoint=body.authorization_endpoint or found.get("authorization_endpoint"),
        token_endpoint=token_endpoint,
        revocation_endpoint=body.revocation_endpoint or found.get("revocation_endpoint"),
        device_authorization_endpoint=(body.device_authorization_endpoint
                                       or found.get("device_authorization_endpoint")),
        client_id=body.client_id, scopes=list(body.scopes), created_at=utcnow(),
        client_secret=(box.seal(tenant, f"{provider_id}/client_secret", body.client_secret.get_secret_value())
                       if body.client_secret is not None else None))
    async with plane.db() as db:
        await add_named(db, row, "connection provider")
    return provider_out(row)


async def list_providers(plane: ControlPlane, tenant: str) -> ProviderList:
    return ProviderList(items=await list_named(plane.db, ConnectionProviderRow, tenant, provider_out))


async def delete_provider(plane: ControlPlane, tenant: str, ref: str) -> None:
    async with plane.db() as db:
        row = await find_provider(db, tenant, ref)
        used = await db.scalar(select(func.count()).select_from(ConnectionRow).where(
            ConnectionRow.provider_id == row.id, ConnectionRow.state != "revoked"))
        if used:
            raise InvalidState(f"provider {ref} has connections that are not revoked", code="provider_in_use")
        await db.delete(row)
        await db.commit()


# -- connections -----------------------------------------------------------------------------------------

async def create_connection(plane: ControlPlane, tenant: str, body: ConnectionCreate) -> ConnectionOut:
    async with plane.db() as db:
        provider = await find_provider(db, tenant, body.provider)
        row = ConnectionRow(id=new_id("con"), tenant=tenant, name=body.name, provider_id=provider.id,
                            scopes=list(body.scopes) if body.scopes is not None else None, state="pending",
                            refreshes=0, created_at=utcnow())
        await add_named(db, row, "connection")
        return connection_out(row, provider)


async def list_connections(plane: ControlPlane, tenant: str) -> ConnectionList:
    async with plane.db() as db:
        joined = ConnectionRow.provider_id == ConnectionProviderRow.id
        rows = (await db.execute(select(ConnectionRow, ConnectionProviderRow)
                                 .join(ConnectionProviderRow, joined)
                                 .where(ConnectionRow.tenant == tenant).order_by(ConnectionRow.name))).all()
        return ConnectionList(items=[connection_out(c, p) for c, p in rows])


async def get_connection(plane: ControlPlane, tenant: str, ref: str) -> ConnectionOut:
    async with plane.db() as db:
        row = await find_connection(db, tenant, ref)
        provider = await db.get(ConnectionProviderRow, row.provider_id)
        assert provider is not None
        return connection_out(row, provider)


# -- sign-in ---------------------------------------------------------------------------------------------

async def start_login(plane: ControlPlane, tenant: str, ref: str, mode: str, base_url: str) -> LoginOut:
    """Start a sign-in; ``base_url`` is where the browser reaches this API (for the redirect URI)."""
    box = sealer(plane)
    ttl = plane.settings.connection_login_ttl
    async with plane.db() as db:
        conn = await find_connection(db, tenant, ref)
        if conn.state == "revoked":
            raise InvalidState(f"connection {ref} was revoked; add a new one", code="connection_revoked")
        provider = await db.get(ConnectionProviderRow, conn.provider_id)
        assert provider is not None
    client = oauth_client(plane, provider, conn.scopes)
    if mode == "device":
        start = await client.start_device()
        login_id = new_id("lgn")
        expires = time.time() + min(start.expires_in, ttl)
        row = ConnectionLoginRow(id=login_id, kind="device", tenant=tenant, connection_id=conn.id,
                                 secret=box.seal(tenant, f"{login_id}/device", start.device_code),
                                 expires_at=expires, interval=start.interval)
        out = LoginOut(mode="device", login_id=login_id, user_code=start.user_code,
                       verification_uri=start.verification_uri,
                       verification_uri_complete=start.verification_uri_complete, interval=start.interval,
                       expires_at=datetime.fromtimestamp(expires, UTC))
    else:
        state = secrets.token_urlsafe(32)
        verifier = secrets.token_urlsafe(64)
        key = _state_key(state)
        redirect_uri = base_url.rstrip("/") + CALLBACK_PATH
        url = client.authorization_url(redirect_uri, state, verifier)
        expires = time.time() + ttl
        row = ConnectionLoginRow(id=key, kind="code", tenant=tenant, connection_id=conn.id,
                                 secret=box.seal(tenant, f"{key}/verifier", verifier),
                                 redirect_uri=redirect_uri, expires_at=expires, interval=0.0)
        out = LoginOut(mode="code", authorization_url=url, expires_at=datetime.fromtimestamp(expires, UTC))
    async with plane.db() as db:
        db.add(row)
        await db.commit()
    return out


async def _claim(plane: ControlPlane, login_id: str) -> bool:
    """Single use: exactly one caller marks the sign-in used, and only before it expires."""
    async with plane.db() as db:
        result = await db.execute(update(ConnectionLoginRow).where(
            ConnectionLoginRow.id == login_id, ConnectionLoginRow.used_at.is_(None),
            ConnectionLoginRow.expires_at > time.time()).values(used_at=utcnow()))
        await db.commit()
    return bool(getattr(result, "rowcount", 0) == 1)


async def _activate(plane: ControlPlane, connection_id: str, tokens: Any) -> ConnectionOut:
    async with plane.db() as db:
        conn = await db.get(ConnectionRow, connection_id, populate_existing=True)
        if conn is None or conn.state == "revoked":
            raise InvalidState("the connection was revoked during the sign-in", code="connection_revoked")
        store_tokens(plane, conn, tokens)
        conn.state = "active"
        conn.connected_at = utcnow()
        provider = await db.get(ConnectionProviderRow, conn.provider_id)
        assert provider is not None
        await db.commit()
        return connection_out(conn, provider)


async def complete_code_login(plane: ControlPlane, state: str, code: str | None,
                              error: str | None) -> ConnectionOut:
    """The browser came back (``GET /v1/connections/callback``): exchange the code with the PKCE verifier."""
    key = _state_key(state)
    async with plane.db() as db:
        login = await db.get(ConnectionLoginRow, key)
    if login is None or login.kind != "code":
        raise LoginStateInvalid("unknown sign-in state")
    if not await _claim(plane, key):
        raise LoginStateInvalid("this sign-in was already completed or has expired")
    if error is not None or not code:
        raise ApiError(f"the provider did not sign in: {error or 'no code'}", code="login_denied",
                       status=400)
    verifier = sealer(plane).open(login.tenant, f"{key}/verifier", login.secret)
    async with plane.db() as db:
        conn = await db.get(ConnectionRow, login.connection_id)
        provider = await db.get(ConnectionProviderRow, conn.provider_id) if conn else None
    if conn is None or provider is None:
        raise LoginStateInvalid("the connection of this sign-in is gone")
    assert login.redirect_uri is not None
    tokens = await oauth_client(plane, provider, conn.scopes).exchange_code(login.redirect_uri, code,
                                                                             verifier)
    return await _activate(plane, conn.id, tokens)


async def poll_device_login(plane: ControlPlane, tenant: str, ref: str, login_id: str) -> LoginPollOut:
    async with plane.db() as db:
        conn = await find_connection(db, tenant, ref)
        login = await db.get(ConnectionLoginRow, login_id, populate_existing=True)
        provider = await db.get(ConnectionProviderRow, conn.provider_id)
        assert provider is not None
        current = connection_out(conn, provider)
    if login is None or login.kind != "device" or login.connection_id != conn.id:
        raise LoginStateInvalid(f"no device sign-in {login_id} for connection {ref}")
    if login.used_at is not None:
        return LoginPollOut(status="connected" if conn.state == "active" else "expired", connection=current)
    if login.expires_at <= time.time():
        return LoginPollOut(status="expired", connection=current)
    device_code = sealer(plane).open(tenant, f"{login_id}/device", login.secret)
    try:
        tokens = await oauth_client(plane, provider, conn.scopes).poll_device(device_code)
    except ProviderError as exc:
        if exc.error in ("authorization_pending", "slow_down"):
            interval = login.interval + (5 if exc.error == "slow_down" else 0)
            if interval != login.interval:
                async with plane.db() as db:
                    await db.execute(update(ConnectionLoginRow).where(ConnectionLoginRow.id == login_id)
                                     .values(interval=interval))
                    await db.commit()
            return LoginPollOut(status="pending", interval=interval, connection=current)
        if exc.error in ("access_denied", "expired_token"):
            await _claim(plane, login_id)
            return LoginPollOut(status="denied" if exc.error == "access_denied" else "expired",
                                connection=current)
        raise
    if not await _claim(plane, login_id):
        raise LoginStateInvalid("this sign-in was already completed or has expired")
    return LoginPollOut(status="connected", connection=await _activate(plane, conn.id, tokens))


# -- revocation ------------------------------------------------------------------------------------------

async def _nodes_binding(plane: ControlPlane, tenant: str, connection_id: str) -> list[NodeRow]:
    async with plane.db() as db:
        rows = (await db.execute(
            select(SessionRow.node_id, SessionPolicyRow.policy)
            .join(SessionPolicyRow, SessionPolicyRow.session_id == SessionRow.id)
            .where(SessionRow.tenant == tenant, SessionRow.state.in_(ACTIVE_STATES),
                   SessionRow.node_id.is_not(None)))).all()
        node_ids = sorted({node_id for node_id, policy in rows
                           if any(c.get("connection") == connection_id
                                  for c in (policy or {}).get("connections", []))})
        nodes = [await db.get(NodeRow, n) for n in node_ids]
    return [n for n in nodes if n is not None]


async def revoke_connection(plane: ControlPlane, tenant: str, ref: str) -> RevokeOut:
    """Final: the record stops handing out tokens, every node serving a session that binds it drops its
    token at once, then the provider is asked to revoke the refresh (and access) token."""
    box = sealer(plane)
    async with plane.db() as db:
        conn = await find_connection(db, tenant, ref)
        provider = await db.get(ConnectionProviderRow, conn.provider_id)
        assert provider is not None
        if conn.state == "revoked":
            raise InvalidState(f"connection {ref} is already revoked", code="connection_revoked")
        refresh = box.open(tenant, f"{conn.id}/refresh", conn.refresh_token) if conn.refresh_token else None
        access = box.open(tenant, f"{conn.id}/access", conn.access_token) if conn.access_token else None
        result = await db.execute(update(ConnectionRow).where(
            ConnectionRow.id == conn.id, ConnectionRow.state != "revoked").values(
            state="revoked", revoked_at=utcnow(), refresh_token=None, access_token=None,
            access_expires_at=None, refresh_lease_until=None))
        await db.execute(update(ConnectionLoginRow).where(ConnectionLoginRow.connection_id == conn.id,
                                                          ConnectionLoginRow.used_at.is_(None))
                         .values(used_at=utcnow()))
        await db.commit()
        if getattr(result, "rowcount", 0) != 1:
            raise InvalidState(f"connection {ref} is already revoked", code="connection_revoked")
    notified: list[str] = []
    unreached: list[str] = []
    for node in await _nodes_binding(plane, tenant, conn.id):
        told = await quietly(plane.node_client(node).revoke_connection(conn.id),
                             f"node {node.id} was not told that connection {conn.id} is revoked")
        (notified if told else unreached).append(node.id)
    provider_revoked = False
    client = oauth_client(plane, provider, conn.scopes)
    try:
        if refresh is not None:
            provider_revoked = await client.revoke(refresh, "refresh_token")
        if access is not None:
            provider_revoked = await client.revoke(access, "access_token") or provider_revoked
    except ProviderError as exc:
        log.warning("provider %s did not revoke the tokens of %s: %s", provider.name, conn.id, exc.message)
    async with plane.db() as db:
        row = await db.get(ConnectionRow, conn.id, populate_existing=True)
        assert row is not None
        return RevokeOut(connection=connection_out(row, provider), nodes_notified=notified,
                         nodes_unreached=unreached, provider_revoked=provider_revoked)

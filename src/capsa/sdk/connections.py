"""Connections from the SDK (``client.connections``, ``client.connection_providers``): OAuth 2.0 providers,
connections (a person's sign-in, held by the control plane), sign-in and revocation.

Nothing here ever returns a credential: the client secret is sent once with the provider, tokens never
leave the control plane and the node. A session's policy binds a connection to destinations
(``{"connection": "github", "domains": ["api.github.com"]}``); the node's broker adds the current access
token to those requests.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from datetime import datetime
from typing import Any

from capsa.common.wire.connections import ConnectionOut, LoginOut, LoginPollOut, ProviderOut, RevokeOut
from capsa.sdk.errors import CapsaClientError
from capsa.sdk.paths import seg
from capsa.sdk.resource import Resource

__all__ = ["AsyncConnectionProviders", "AsyncConnections", "ConnectionInfo", "Login", "LoginPoll",
           "ProviderInfo", "Revocation"]


ProviderInfo = ProviderOut
"""An OAuth 2.0 provider (``has_client_secret`` only: the secret itself is never returned)."""
ConnectionInfo = ConnectionOut
"""A connection: a sign-in with a provider, held by the control plane (``state``: pending, active or
revoked)."""
Login = LoginOut
"""A sign-in started: a URL to open (``code``) or a code to type in elsewhere (``device``)."""
LoginPoll = LoginPollOut
"""Where a device sign-in stands, and the connection."""
Revocation = RevokeOut
"""A revoked connection, and which nodes were told to stop injecting its token."""


class AsyncConnectionProviders(Resource):
    """OAuth 2.0 providers of the tenant (``client.connection_providers``)."""

    async def create(self, name: str, *, client_id: str, client_secret: str | None = None,
                     issuer: str | None = None, authorization_endpoint: str | None = None,
                     token_endpoint: str | None = None, revocation_endpoint: str | None = None,
                     device_authorization_endpoint: str | None = None,
                     scopes: builtins.list[str] | None = None) -> ProviderInfo:
        """Give the endpoints, or ``issuer`` to find them by discovery. The client secret is write-only."""
        body: dict[str, Any] = {"name": name, "client_id": client_id, "scopes": scopes or []}
        for key, value in (("client_secret", client_secret), ("issuer", issuer),
                           ("authorization_endpoint", authorization_endpoint),
                           ("token_endpoint", token_endpoint), ("revocation_endpoint", revocation_endpoint),
                           ("device_authorization_endpoint", device_authorization_endpoint)):
            if value is not None:
                body[key] = value
        return await self._call(ProviderInfo, "POST", "/connection-providers", json=body)

    async def list(self) -> builtins.list[ProviderInfo]:
        return await self._list(ProviderInfo, "/connection-providers")

    async def delete(self, provider: str) -> None:
        await self._client.request("DELETE", f"/connection-providers/{seg(provider)}")


class AsyncConnections(Resource):
    """The tenant's connections (``client.connections``)."""

    async def create(self, name: str, provider: str, *,
                     scopes: builtins.list[str] | None = None) -> ConnectionInfo:
        body: dict[str, Any] = {"name": name, "provider": provider}
        if scopes is not None:
            body["scopes"] = scopes
        return await self._call(ConnectionInfo, "POST", "/connections", json=body)

    async def list(self) -> builtins.list[ConnectionInfo]:
        return await self._list(ConnectionInfo, "/connections")

    async def get(self, connection: str) -> ConnectionInfo:
        return await self._call(ConnectionInfo, "GET", f"/connections/{seg(connection)}")

    async def login(self, connection: str, *, device: bool = False) -> Login:
        """Start a sign-in: the authorization URL to open (code with PKCE) or, with ``device``, the code
        a person enters at the verification URI (then :meth:`wait_for_device`)."""
        body = {"mode": "device" if device else "code"}
        return await self._call(Login, "POST", f"/connections/{seg(connection)}/login",
                                                    json=body)

    async def poll(self, connection: str, login_id: str) -> LoginPoll:
        """Ask once whether a device sign-in was approved."""
        path = f"/connections/{seg(connection)}/logins/{seg(login_id)}/poll"
        return await self._call(LoginPoll, "POST", path)

    async def wait_for_device(self, connection: str, login: Login, *,
                              deadline: float | None = None) -> ConnectionInfo:
        """Poll a device sign-in at the provider's interval until it is approved (or refused, or expires:
        CapsaClientError). ``deadline``: seconds to wait at most (default: until the sign-in expires)."""
        if login.login_id is None:
            raise CapsaClientError("not a device sign-in")
        end = time.monotonic() + (deadline if deadline is not None
                                  else max(0.0, login.expires_at.timestamp() - time.time()))
        interval = login.interval or 5.0
        while True:
            answer = await self.poll(connection, login.login_id)
            if answer.status == "connected":
                return answer.connection
            if answer.status != "pending":
                raise CapsaClientError(f"the device sign-in of {connection} ended: {answer.status}")
            interval = answer.interval or interval
            if time.monotonic() + interval > end:
                raise CapsaClientError(f"the device sign-in of {connection} was not approved in time")
            await asyncio.sleep(interval)

    async def wait_until_active(self, connection: str, *, after: datetime | None = None,
                                deadline: float = 600.0, interval: float = 1.0) -> ConnectionInfo:
        """Wait for a code sign-in to come back through the callback (the connection turns ``active``);
        ``after``: the ``connected_at`` it had before this sign-in, which must change."""
        end = time.monotonic() + deadline
        while True:
            info = await self.get(connection)
            if info.state == "active" and info.connected_at is not None and (
                    after is None or info.connected_at > after):
                return info
            if info.state == "revoked":
                raise CapsaClientError(f"connection {connection} is revoked")
            if time.monotonic() + interval > end:
                raise CapsaClientError(f"nobody signed in to {connection} in time")
            await asyncio.sleep(interval)

    async def revoke(self, connection: str) -> Revocation:
        """Stop injection on every node at once and revoke the tokens at the provider. Final."""
        return await self._call(Revocation, "POST", f"/connections/{seg(connection)}/revoke")

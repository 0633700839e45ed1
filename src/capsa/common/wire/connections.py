"""Answers of ``/v1/connection-providers`` and ``/v1/connections``: OAuth 2.0 providers, connections,
sign-ins and revocations.

No answer carries a credential: a provider's client secret and a connection's tokens are write-only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from capsa.common.wire.base import Answer, known

__all__ = ["ConnectionList", "ConnectionOut", "ConnectionState", "LoginMode", "LoginOut", "LoginPollOut",
           "ProviderList", "ProviderOut", "RevokeOut"]

ConnectionState = Literal["pending", "active", "revoked"]
LoginMode = Literal["code", "device"]
"""``code``: authorization code with PKCE, the browser comes back to ``/v1/connections/callback``;
``device``: the device authorization grant (a code to type in elsewhere), for headless use."""


class ProviderOut(Answer):
    id: str
    name: str
    issuer: str | None
    authorization_endpoint: str | None
    token_endpoint: str
    revocation_endpoint: str | None
    device_authorization_endpoint: str | None
    client_id: str
    has_client_secret: bool
    scopes: list[str]
    created_at: datetime


class ProviderList(Answer):
    items: list[ProviderOut]


class ConnectionOut(Answer):
    id: str
    name: str
    provider_id: str
    provider: str
    scopes: list[str]
    state: Annotated[str, known(ConnectionState)]
    """``pending``: nobody has signed in (or the provider refused the refresh token); ``active``: the
    broker can inject its token; ``revoked``: final."""
    access_expires_at: datetime | None = None
    """When the current access token (never shown) expires."""
    refreshes: int
    created_at: datetime
    connected_at: datetime | None = None
    revoked_at: datetime | None = None


class ConnectionList(Answer):
    items: list[ConnectionOut]


class LoginOut(Answer):
    mode: LoginMode
    login_id: str | None = None
    """Device sign-in: what ``POST .../logins/{login_id}/poll`` takes."""
    authorization_url: str | None = None
    """Code sign-in: open it in a browser; the provider sends the browser back to capsa."""
    user_code: str | None = None
    verification_uri: str | None = None
    verification_uri_complete: str | None = None
    interval: float | None = None
    expires_at: datetime


class LoginPollOut(Answer):
    status: Literal["pending", "connected", "denied", "expired"]
    interval: float | None = None
    """Seconds to wait before the next poll."""
    connection: ConnectionOut


class RevokeOut(Answer):
    connection: ConnectionOut
    nodes_notified: list[str]
    """Nodes told to stop injecting its token (those serving sessions that bind it)."""
    nodes_unreached: list[str]
    provider_revoked: bool
    """The provider's revocation endpoint accepted the refresh (and access) token."""

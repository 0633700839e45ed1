"""Request and response bodies of ``/v1/connection-providers`` and ``/v1/connections``.

No answer carries a credential: a provider's client secret and a connection's tokens are write-only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = [
    "ConnectionCreate",
    "ConnectionList",
    "ConnectionOut",
    "LoginOut",
    "LoginPollOut",
    "LoginStart",
    "ProviderCreate",
    "ProviderList",
    "ProviderOut",
    "RevokeOut",
]

def _endpoint(value: str) -> str:
    """The URL's form; where it may point (https on public addresses, http only inside
    ``CAPSA_OAUTH_ALLOW_NETWORKS``) is checked when the provider is registered (oauth_client.Outbound)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("an OAuth endpoint must be an https:// URL")
    if not parts.hostname or parts.fragment or parts.username or parts.password:
        raise ValueError("an OAuth endpoint needs a host and no fragment or credentials")
    return value


Endpoint = Annotated[str, Field(max_length=2048), AfterValidator(_endpoint)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Scope = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21\x23-\x5b\x5d-\x7e]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProviderCreate(_Strict):
    """Endpoints given, or found by discovery from ``issuer`` (OpenID Connect or RFC 8414 metadata);
    endpoints given explicitly win over discovered ones."""

    name: Name
    issuer: Endpoint | None = None
    authorization_endpoint: Endpoint | None = None
    token_endpoint: Endpoint | None = None
    revocation_endpoint: Endpoint | None = None
    device_authorization_endpoint: Endpoint | None = None
    client_id: Annotated[str, Field(min_length=1, max_length=256)]
    client_secret: Annotated[SecretStr, Field(min_length=1, max_length=4096)] | None = None
    """Write-only: sealed at rest, never returned; none for a public client (PKCE only)."""
    scopes: Annotated[list[Scope], Field(max_length=64)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _endpoints_or_issuer(self) -> ProviderCreate:
        if self.issuer is None and self.token_endpoint is None:
            raise ValueError("give token_endpoint (and the others) or issuer for discovery")
        return self


class ProviderOut(BaseModel):
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


class ProviderList(BaseModel):
    items: list[ProviderOut]


class ConnectionCreate(_Strict):
    name: Name
    provider: Annotated[str, Field(min_length=1, max_length=128)]
    """The provider's id or name."""
    scopes: Annotated[list[Scope], Field(max_length=64)] | None = None
    """Scopes to ask for instead of the provider's."""


class ConnectionOut(BaseModel):
    id: str
    name: str
    provider_id: str
    provider: str
    scopes: list[str]
    state: Literal["pending", "active", "revoked"]
    """``pending``: nobody has signed in (or the provider refused the refresh token); ``active``: the
    broker can inject its token; ``revoked``: final."""
    access_expires_at: datetime | None = None
    """When the current access token (never shown) expires."""
    refreshes: int
    created_at: datetime
    connected_at: datetime | None = None
    revoked_at: datetime | None = None


class ConnectionList(BaseModel):
    items: list[ConnectionOut]


class LoginStart(_Strict):
    mode: Literal["code", "device"] = "code"
    """``code``: authorization code with PKCE, the browser comes back to ``/v1/connections/callback``;
    ``device``: the device authorization grant (a code to type in elsewhere), for headless use."""


class LoginOut(BaseModel):
    mode: Literal["code", "device"]
    login_id: str | None = None
    """Device sign-in: what ``POST .../logins/{login_id}/poll`` takes."""
    authorization_url: str | None = None
    user_code: str | None = None
    verification_uri: str | None = None
    verification_uri_complete: str | None = None
    interval: float | None = None
    expires_at: datetime


class LoginPollOut(BaseModel):
    status: Literal["pending", "connected", "denied", "expired"]
    interval: float | None = None
    """Seconds to wait before the next poll."""
    connection: ConnectionOut


class RevokeOut(BaseModel):
    connection: ConnectionOut
    nodes_notified: list[str]
    """Nodes told to stop injecting its token (those serving sessions that bind it)."""
    nodes_unreached: list[str]
    provider_revoked: bool
    """The provider's revocation endpoint accepted the refresh (and access) token."""

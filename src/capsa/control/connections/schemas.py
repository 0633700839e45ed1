"""Request bodies of ``/v1/connection-providers`` and ``/v1/connections`` (their answers are
:mod:`capsa.common.wire.connections`)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

from capsa.common.wire.connections import LoginMode

__all__ = [
    "ConnectionCreate",
    "LoginStart",
    "ProviderCreate",
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


class ConnectionCreate(_Strict):
    name: Name
    provider: Annotated[str, Field(min_length=1, max_length=128)]
    """The provider's id or name."""
    scopes: Annotated[list[Scope], Field(max_length=64)] | None = None
    """Scopes to ask for instead of the provider's."""


class LoginStart(_Strict):
    mode: LoginMode = "code"

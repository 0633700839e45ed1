"""Loading and sealing connection records: the pieces :mod:`~capsa.control.connections.service` (the API's
operations) and :mod:`~capsa.control.connections.tokens` (tokens for nodes, refresh) share."""

from __future__ import annotations

from datetime import UTC, datetime

from capsa.common.wire.connections import ConnectionOut, ProviderOut
from capsa.control.connections.oauth_client import Endpoints, OAuthClient, Outbound, TokenSet
from capsa.control.errors import ApiError, NotFound
from capsa.control.plane import ControlPlane
from capsa.control.secretbox import SecretSealer
from capsa.control.store.connection_models import ConnectionProviderRow, ConnectionRow
from capsa.control.store.db import DbSession
from capsa.control.store.named import by_ref

__all__ = ["connection_out", "find_connection", "find_provider", "oauth_client", "outbound", "provider_out",
           "sealer", "store_tokens"]


def sealer(plane: ControlPlane) -> SecretSealer:
    found = SecretSealer.from_settings(plane.settings)
    if found is None:
        raise ApiError("connections keep credentials sealed: set CAPSA_SECRET_KEY or CAPSA_SECRET_KEY_FILE",
                       code="secrets_unavailable", status=503)
    return found


async def find_provider(db: DbSession, tenant: str, ref: str) -> ConnectionProviderRow:
    row = await db.scalar(by_ref(ConnectionProviderRow, tenant, ref, "prv"))
    if row is None:
        raise NotFound(f"connection provider {ref} not found")
    return row


async def find_connection(db: DbSession, tenant: str, ref: str) -> ConnectionRow:
    row = await db.scalar(by_ref(ConnectionRow, tenant, ref, "con").execution_options(populate_existing=True))
    if row is None:
        raise NotFound(f"connection {ref} not found")
    return row


def outbound(plane: ControlPlane) -> Outbound:
    """Where this replica may connect for providers: screened by its resolver, with the operator's
    ``CAPSA_OAUTH_ALLOW_NETWORKS``."""
    return Outbound(plane.resolver, tuple(plane.settings.oauth_allow_networks))


def oauth_client(plane: ControlPlane, provider: ConnectionProviderRow,
                 scopes: list[str] | None = None) -> OAuthClient:
    secret = (sealer(plane).open(provider.tenant, f"{provider.id}/client_secret", provider.client_secret)
              if provider.client_secret is not None else None)
    ca = str(plane.settings.oauth_ca_file) if plane.settings.oauth_ca_file else None
    return OAuthClient(Endpoints(provider.token_endpoint, provider.authorization_endpoint,
                                 provider.revocation_endpoint, provider.device_authorization_endpoint),
                       provider.client_id, secret, scopes=scopes if scopes is not None else provider.scopes,
                       outbound=outbound(plane), ca_file=ca)


def store_tokens(plane: ControlPlane, row: ConnectionRow, tokens: TokenSet) -> None:
    """Seal a new token set into the row (a refresh answer without a refresh token keeps the old one)."""
    box = sealer(plane)
    row.access_token = box.seal(row.tenant, f"{row.id}/access", tokens.access_token)
    if tokens.refresh_token is not None:
        row.refresh_token = box.seal(row.tenant, f"{row.id}/refresh", tokens.refresh_token)
    row.access_expires_at = tokens.expires_at
    row.access_lifetime = tokens.lifetime


def provider_out(row: ConnectionProviderRow) -> ProviderOut:
    return ProviderOut(id=row.id, name=row.name, issuer=row.issuer,
                       authorization_endpoint=row.authorization_endpoint, token_endpoint=row.token_endpoint,
                       revocation_endpoint=row.revocation_endpoint,
                       device_authorization_endpoint=row.device_authorization_endpoint,
                       client_id=row.client_id, has_client_secret=row.client_secret is not None,
                       scopes=list(row.scopes or []), created_at=row.created_at)


def connection_out(row: ConnectionRow, provider: ConnectionProviderRow) -> ConnectionOut:
    expires = (datetime.fromtimestamp(row.access_expires_at, UTC)
               if row.access_expires_at is not None and row.state == "active" else None)
    return ConnectionOut(id=row.id, name=row.name, provider_id=provider.id, provider=provider.name,
                         scopes=list(row.scopes if row.scopes is not None else provider.scopes or []),
                         state=row.state,
                         access_expires_at=expires, refreshes=row.refreshes, created_at=row.created_at,
                         connected_at=row.connected_at, revoked_at=row.revoked_at)

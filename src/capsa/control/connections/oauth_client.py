"""The OAuth 2.0 client side of connections, on authlib's httpx client: discovery, the authorization URL
with PKCE (S256), the code exchange, the device authorization grant, refresh and revocation.

Only the control plane runs this: it holds the provider's client secret and every refresh token.
Provider errors become :class:`ProviderError` carrying only a standard OAuth error code (RFC 6749 section 5.2,
RFC 8628 section 3.5, RFC 7009): whatever else a provider or a transport says is logged here, never shown to
the tenant. Nothing here logs a token.

Every endpoint, configured or discovered, is an :class:`Outbound` destination: ``https://`` whose host
resolves only to public addresses, unless the operator's ``CAPSA_OAUTH_ALLOW_NETWORKS`` covers it (then
``http://`` too); every connection goes to the address screened (:mod:`capsa.common.pinned_http`).
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx2
from authlib.integrations.httpx_client import AsyncOAuth2Client, OAuthError

from capsa.common.addresses import IPNetwork, is_public_address
from capsa.common.destinations import DestinationRefused, ResolveError, Resolver, SystemResolver, screen_host
from capsa.common.pinned_http import pinned_transport
from capsa.control.errors import ApiError

__all__ = ["DEVICE_GRANT", "STANDARD_ERRORS", "DeviceStart", "Endpoints", "OAuthClient", "Outbound",
           "ProviderError", "TokenSet", "discover"]

log = logging.getLogger(__name__)

# authlib's client is an httpx2.AsyncClient (capsa depends on httpx2: authlib's fallback to httpx is
# deprecated and warns at every import), so its transport comes from httpx2 too.
_AUTHLIB_HTTP = httpx2

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
_DEFAULT_LIFETIME = 3600.0
STANDARD_ERRORS = frozenset({
    # RFC 6749 section 5.2 (token endpoint)
    "invalid_request", "invalid_client", "invalid_grant", "unauthorized_client", "unsupported_grant_type",
    "invalid_scope",
    # RFC 8628 section 3.5 (device grant polling)
    "authorization_pending", "slow_down", "access_denied", "expired_token",
    # RFC 7009 section 2.2.1 (revocation)
    "unsupported_token_type",
})
"""The provider error codes a tenant may see; any other ``error`` becomes ``invalid_response``."""


class ProviderError(ApiError):
    """The provider refused or could not be reached; ``error`` is a standard OAuth error code (or one of
    capsa's own: ``server_error``, ``invalid_response``, ``discovery_failed``, ``invalid_issuer``)."""

    code, status, title = "provider_error", 502, "Provider error"

    def __init__(self, message: str, error: str = "server_error", status: int = 502) -> None:
        super().__init__(message, status=status)
        self.error = error


@dataclass(frozen=True)
class Endpoints:
    token: str
    authorization: str | None = None
    revocation: str | None = None
    device_authorization: str | None = None


@dataclass(frozen=True)
class TokenSet:
    """Tokens from a provider's token endpoint (their repr leaves the tokens out)."""

    access_token: str = field(repr=False)
    refresh_token: str | None = field(repr=False)
    expires_at: float
    lifetime: float


@dataclass(frozen=True)
class DeviceStart:
    """A device authorization under way (its repr leaves the device code out)."""

    device_code: str = field(repr=False)
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    expires_in: float
    interval: float


@dataclass(frozen=True)
class Outbound:
    """Where the control plane may connect on a provider's behalf: names resolve through ``resolver`` and
    must be public unless in ``allow_networks`` (``CAPSA_OAUTH_ALLOW_NETWORKS``)."""

    resolver: Resolver = field(default_factory=SystemResolver)
    allow_networks: Sequence[IPNetwork] = ()

    def transport(self, verify: ssl.SSLContext | bool, http: ModuleType = httpx) -> Any:
        return pinned_transport(self.resolver, self.allow_networks, verify=verify, http=http)

    async def check(self, what: str, url: str) -> None:
        """Refuse (``destination_refused``, 422) an endpoint that is not ``https://`` on a public address,
        or ``http(s)://`` on an address in the allow-list. A name that does not resolve is refused too."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password \
                or parts.fragment:
            raise DestinationRefused(f"{what} must be an http(s) URL with a host, without credentials or "
                                     "fragment")
        try:
            address = await screen_host(parts.hostname, self.resolver, self.allow_networks)
        except ResolveError:
            raise DestinationRefused(f"{what} {parts.hostname} does not resolve") from None
        except DestinationRefused as exc:
            raise DestinationRefused(f"{what} refused: {exc.message}") from None
        if parts.scheme == "http" and is_public_address(address):
            raise DestinationRefused(f"{what} must be https:// (http:// only in CAPSA_OAUTH_ALLOW_NETWORKS)")


def _standard(error: object) -> str:
    return error if isinstance(error, str) and error in STANDARD_ERRORS else "invalid_response"


def _tokens(token: dict[str, Any]) -> TokenSet:
    access = token.get("access_token")
    if not isinstance(access, str) or not access:
        raise ProviderError("the provider's token answer has no access_token", "invalid_response")
    try:
        lifetime = float(token.get("expires_in") or _DEFAULT_LIFETIME)
    except (TypeError, ValueError):
        lifetime = _DEFAULT_LIFETIME
    refresh = token.get("refresh_token")
    return TokenSet(access, refresh if isinstance(refresh, str) and refresh else None,
                    time.time() + lifetime, lifetime)


def _verify(ca_file: str | None) -> ssl.SSLContext | bool:
    if ca_file is None:
        return True
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=ca_file)
    return ctx


_DISCOVERED = ("authorization_endpoint", "token_endpoint", "revocation_endpoint",
               "device_authorization_endpoint")


@contextlib.contextmanager
def _reaching(exchange: str, *, refused: tuple[str, str]) -> Iterator[None]:
    """Around one HTTP exchange with a provider (``exchange`` names it in messages): a destination the
    outbound checks refuse raises ProviderError(``refused``: message, code); a failed exchange raises
    ProviderError("<exchange> failed: <error class>")."""
    try:
        yield
    except DestinationRefused as exc:
        log.warning("%s refused: %s", exchange, exc.message)
        raise ProviderError(*refused) from None
    except httpx.HTTPError as exc:
        log.warning("%s failed: %r", exchange, exc)
        raise ProviderError(f"{exchange} failed: {exc.__class__.__name__}") from None


async def discover(issuer: str, *, outbound: Outbound, ca_file: str | None = None,
                   wait: float = 15.0) -> dict[str, Any]:
    """The provider's metadata: OpenID Connect discovery, else RFC 8414 authorization-server metadata. The
    issuer and every endpoint the document names are checked as configured ones are
    (:meth:`Outbound.check`), so a document cannot point the control plane at an internal address."""
    base = issuer.rstrip("/")
    await outbound.check("issuer", base)
    exchange = f"discovery at {base}"
    refused = (f"{exchange} was refused (destination_refused)", "discovery_failed")
    async with httpx.AsyncClient(transport=outbound.transport(_verify(ca_file)), timeout=wait,
                                 follow_redirects=False, trust_env=False) as client:
        for path in ("/.well-known/openid-configuration", "/.well-known/oauth-authorization-server"):
            with _reaching(exchange, refused=refused):
                response = await client.get(base + path)
            if response.status_code == 200:
                try:
                    data = response.json()
                except ValueError:
                    break
                if isinstance(data, dict) and data.get("token_endpoint"):
                    if str(data.get("issuer", "")).rstrip("/") != base:
                        raise ProviderError(f"discovery at {base} names another issuer", "invalid_issuer")
                    for name in _DISCOVERED:
                        if data.get(name) is not None:
                            value = data[name]
                            if not isinstance(value, str) or len(value) > 2048:
                                raise DestinationRefused(f"discovered {name} is not a URL")
                            await outbound.check(f"discovered {name}", value)
                    return data
    raise ProviderError(f"no OAuth/OpenID metadata found at {base}", "discovery_failed")


class OAuthClient:
    """One provider's client (``client_secret`` None: a public client, PKCE only)."""

    def __init__(self, endpoints: Endpoints, client_id: str, client_secret: str | None, *,
                 scopes: list[str], outbound: Outbound, ca_file: str | None = None,
                 timeout: float = 15.0) -> None:
        self.endpoints = endpoints
        self._outbound = outbound
        self._client_id, self._secret = client_id, client_secret
        self._scope = " ".join(scopes) or None
        self._verify = _verify(ca_file)
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"OAuthClient({self._client_id!r}, <secret hidden>)"

    def _session(self, redirect_uri: str | None = None) -> AsyncOAuth2Client:
        return AsyncOAuth2Client(
            client_id=self._client_id, client_secret=self._secret, scope=self._scope,
            redirect_uri=redirect_uri, code_challenge_method="S256",
            token_endpoint_auth_method="client_secret_basic" if self._secret else "none",
            transport=self._outbound.transport(self._verify, _AUTHLIB_HTTP), timeout=self._timeout,
            trust_env=False,
            follow_redirects=False)

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            with _reaching(f"the provider's {what}", refused=(
                    f"the provider's {what} endpoint is not a permitted destination", "server_error")):
                return await coro
        except OAuthError as exc:
            error = _standard(exc.error)
            log.warning("the provider refused the %s: %.200r (%.500r)", what, exc.error, exc.description)
            status = 409 if error in ("invalid_grant", "access_denied", "expired_token") else 502
            raise ProviderError(f"the provider refused the {what}: {error}", error, status) from None
        except ValueError:
            raise ProviderError(f"the provider's {what} answer is not valid", "invalid_response") from None

    def authorization_url(self, redirect_uri: str, state: str, code_verifier: str) -> str:
        if not self.endpoints.authorization:
            raise ApiError("the provider has no authorization endpoint; sign in with --device",
                           code="login_unsupported", status=409)
        client = self._session(redirect_uri)
        url, _ = client.create_authorization_url(self.endpoints.authorization, state=state,
                                                 code_verifier=code_verifier)
        return str(url)

    async def exchange_code(self, redirect_uri: str, code: str, code_verifier: str) -> TokenSet:
        async with self._session(redirect_uri) as client:
            token = await self._call("code exchange", client.fetch_token(
                self.endpoints.token, grant_type="authorization_code", code=code,
                code_verifier=code_verifier))
        return _tokens(dict(token))

    async def refresh(self, refresh_token: str) -> TokenSet:
        async with self._session() as client:
            token = await self._call("refresh", client.refresh_token(self.endpoints.token,
                                                                     refresh_token=refresh_token))
        out = _tokens(dict(token))
        return out if out.refresh_token != refresh_token else TokenSet(out.access_token, None,
                                                                       out.expires_at, out.lifetime)

    async def start_device(self) -> DeviceStart:
        if not self.endpoints.device_authorization:
            raise ApiError("the provider has no device authorization endpoint", code="login_unsupported",
                           status=409)
        data = {"client_id": self._client_id, **({"scope": self._scope} if self._scope else {})}
        auth = httpx.BasicAuth(self._client_id, self._secret) if self._secret else None
        async with httpx.AsyncClient(transport=self._outbound.transport(self._verify), timeout=self._timeout,
                                     trust_env=False, follow_redirects=False) as client:
            try:
                response = await client.post(self.endpoints.device_authorization, data=data,
                                             auth=auth or httpx.USE_CLIENT_DEFAULT)
                body = response.json()
            except DestinationRefused as exc:
                log.warning("the device authorization endpoint was refused: %s", exc.message)
                raise ProviderError("the device authorization endpoint is not a permitted destination") \
                    from None
            except httpx.HTTPError as exc:
                log.warning("the device authorization failed: %r", exc)
                raise ProviderError(f"the device authorization failed: {exc.__class__.__name__}") from None
            except ValueError:
                raise ProviderError("the device authorization answer is not JSON", "invalid_response") \
                    from None
        if not response.is_success or not isinstance(body, dict) or "device_code" not in body:
            error = _standard(body.get("error") if isinstance(body, dict) else None)
            log.warning("the provider refused the device authorization (%d): %.500r", response.status_code,
                        body)
            raise ProviderError(f"the provider refused the device authorization: {error}", error)
        return DeviceStart(str(body["device_code"]), str(body["user_code"]), str(body["verification_uri"]),
                           body.get("verification_uri_complete"), float(body.get("expires_in", 600)),
                           float(body.get("interval", 5)))

    async def poll_device(self, device_code: str) -> TokenSet:
        """Raises ProviderError with ``error`` authorization_pending / slow_down until the person approves."""
        async with self._session() as client:
            token = await self._call("device grant", client.fetch_token(
                self.endpoints.token, grant_type=DEVICE_GRANT, device_code=device_code))
        return _tokens(dict(token))

    async def revoke(self, token: str, hint: str) -> bool:
        """RFC 7009; False when the provider has no revocation endpoint."""
        if not self.endpoints.revocation:
            return False
        async with self._session() as client:
            response = await self._call("revocation", client.revoke_token(
                self.endpoints.revocation, token=token, token_type_hint=hint))
        if not response.is_success:
            raise ProviderError(f"the provider's revocation answered {response.status_code}")
        return True

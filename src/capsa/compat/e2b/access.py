"""Who is calling and which capsa session an E2B request addresses.

E2B's REST API authenticates with ``X-API-KEY``; here that is a capsa API key (``csk_…``), so a tenant
sees only its own sessions and another tenant's sandbox id answers not-found, exactly as on ``/v1``.
The sandbox daemon protocol (envd) carries no API key: the SDK sends the sandbox's ``envdAccessToken``
as ``X-Access-Token`` and the sandbox id as ``E2b-Sandbox-Id``. capsa hands out a per-sandbox token
(:mod:`capsa.compat.e2b.access_tokens`) that authenticates as the caller's key for that sandbox's envd
calls only; an API key itself is accepted there too. The session is looked up within the key's tenant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import Headers

from capsa.compat.e2b import access_tokens
from capsa.control.auth import Principal, authenticate, authenticate_cached
from capsa.control.plane import ControlPlane
from capsa.control.sessions import relay
from capsa.sdk.e2b import E2B_ENVD_PATH as ENVD_PATH

__all__ = [
    "ACCESS_TOKEN_HEADER",
    "API_KEY_HEADER",
    "SANDBOX_ID_HEADER",
    "EnvdTarget",
    "PlaneGetter",
    "api_caller",
    "api_key",
    "check_credential",
    "envd_principal",
    "envd_target",
    "envd_token",
    "plane",
    "sandbox_id",
]

API_KEY_HEADER = "x-api-key"
ACCESS_TOKEN_HEADER = "x-access-token"
SANDBOX_ID_HEADER = "e2b-sandbox-id"

PlaneGetter = Callable[[], ControlPlane]


def plane(request: Request) -> ControlPlane:
    getter: PlaneGetter = request.app.state.plane_getter
    return getter()


def api_key(headers: Headers) -> str:
    """The credential of a REST call: ``X-API-KEY`` ("" when absent)."""
    return (headers.get(API_KEY_HEADER) or "").strip()


def envd_token(headers: Headers) -> str:
    """The credential of an envd call: ``X-Access-Token``, else ``X-API-KEY`` ("" when absent)."""
    return (headers.get(ACCESS_TOKEN_HEADER) or headers.get(API_KEY_HEADER) or "").strip()


async def check_credential(control: ControlPlane, path: str, headers: Headers) -> None:
    """Raise ``Unauthorized`` unless the request to ``path`` (under the E2B mount) carries a credential
    that its route will accept: what the request guard checks before it reads a body
    (:mod:`capsa.control.request_gate`), from the replica's key cache."""
    if path == ENVD_PATH or path.startswith(ENVD_PATH + "/"):
        await envd_principal(control, headers)
    else:
        await authenticate_cached(control.db, control.keys, api_key(headers) or None)


async def envd_principal(control: ControlPlane, headers: Headers) -> Principal:
    """Who an envd call speaks for: the sandbox's access token (valid only for the sandbox it names in
    ``E2b-Sandbox-Id``) or an API key; else ``Unauthorized``."""
    token = envd_token(headers)
    if access_tokens.is_access_token(token):
        return await access_tokens.principal_of(control, token, sandbox_id(headers))
    return await authenticate_cached(control.db, control.keys, token or None)


def sandbox_id(headers: Headers) -> str:
    """The sandbox an envd call names (``E2b-Sandbox-Id``; "" when absent)."""
    return (headers.get(SANDBOX_ID_HEADER) or "").strip()


async def api_caller(request: Request) -> tuple[Principal, str]:
    """The principal of ``X-API-KEY`` (raises ``Unauthorized``) and the key itself."""
    key = api_key(request.headers)
    async with plane(request).db() as db:
        return await authenticate(db, key or None), key


@dataclass(frozen=True)
class EnvdTarget:
    """Who an envd call speaks for, and the running session it goes to (for the relay's calls)."""

    principal: Principal
    session: relay.SessionTarget

    @property
    def id(self) -> str:
        """The session's id."""
        return self.session.id

    @property
    def sandbox_id(self) -> str:
        return self.session.sandbox_id


async def envd_target(request: Request) -> EnvdTarget:
    """Authenticate an envd call (``X-Access-Token``) and find its running session (``E2b-Sandbox-Id``).

    Raises capsa's ``Unauthorized``, ``NotFound`` (unknown or another tenant's), ``InvalidState`` (paused)
    or ``SessionFailed``."""
    token = envd_token(request.headers)
    control = plane(request)
    session_id = sandbox_id(request.headers)
    if access_tokens.is_access_token(token):
        principal = await access_tokens.principal_of(control, token, session_id)
    else:
        async with control.db() as db:
            principal = await authenticate(db, token or None)
    return EnvdTarget(principal, await relay.running(control, principal.tenant, session_id))

"""``/v1/connection-providers`` and ``/v1/connections``: OAuth 2.0 providers, connections (sign-ins held
by the control plane, whose tokens the broker injects), sign-in and revocation.

``GET /v1/connections/callback`` is the redirect URI of every provider: it takes no API key (the browser
that comes back carries none); the single-use, expiring ``state`` is what binds it to a tenant's sign-in.
"""

from __future__ import annotations

import html
from typing import Annotated

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.responses import HTMLResponse

from capsa.common.wire.connections import (
    ConnectionList,
    ConnectionOut,
    LoginOut,
    LoginPollOut,
    ProviderList,
    ProviderOut,
    RevokeOut,
)
from capsa.control.connections import service as connections
from capsa.control.connections.schemas import ConnectionCreate, LoginStart, ProviderCreate
from capsa.control.deps import Caller, Plane, problems

__all__ = ["providers_router", "router"]

providers_router = APIRouter(prefix="/connection-providers", tags=["connections"],
                             responses=problems(404, 409, 503))
router = APIRouter(prefix="/connections", tags=["connections"], responses=problems(404, 409, 503))


@providers_router.post("", status_code=201, response_model=ProviderOut, responses=problems(502))
async def create_provider(body: ProviderCreate, plane: Plane, caller: Caller) -> ProviderOut:
    """Register an OAuth 2.0 provider (endpoints, or ``issuer`` for discovery). The client secret is
    sealed and never returned."""
    return await connections.create_provider(plane, caller.tenant, body)


@providers_router.get("", response_model=ProviderList)
async def list_providers(plane: Plane, caller: Caller) -> ProviderList:
    return await connections.list_providers(plane, caller.tenant)


@providers_router.delete("/{provider}", status_code=204, response_class=Response)
async def delete_provider(provider: str, plane: Plane, caller: Caller) -> Response:
    """Delete by id or name; refused (``provider_in_use``) while a connection that is not revoked uses it."""
    await connections.delete_provider(plane, caller.tenant, provider)
    return Response(status_code=204)


@router.get("/callback", response_class=HTMLResponse, responses=problems(400, 502))
async def callback(plane: Plane, state: Annotated[str, Query(max_length=512)],
                   code: Annotated[str | None, Query(max_length=4096)] = None,
                   error: Annotated[str | None, Query(max_length=256)] = None) -> HTMLResponse:
    """Where the provider sends the browser back: the code is exchanged (with the PKCE verifier) here."""
    conn = await connections.complete_code_login(plane, state, code, error)
    return HTMLResponse(f"<!doctype html><title>capsa</title><p>Signed in: connection "
                        f"<b>{html.escape(conn.name)}</b> is active. You can close this window.</p>")


@router.post("", status_code=201, response_model=ConnectionOut)
async def create_connection(body: ConnectionCreate, plane: Plane, caller: Caller) -> ConnectionOut:
    """A connection to a provider, ``pending`` until someone signs in (``POST .../login``)."""
    return await connections.create_connection(plane, caller.tenant, body)


@router.get("", response_model=ConnectionList)
async def list_connections(plane: Plane, caller: Caller) -> ConnectionList:
    return await connections.list_connections(plane, caller.tenant)


@router.get("/{connection}", response_model=ConnectionOut)
async def get_connection(connection: str, plane: Plane, caller: Caller) -> ConnectionOut:
    return await connections.get_connection(plane, caller.tenant, connection)


@router.post("/{connection}/login", response_model=LoginOut, responses=problems(502))
async def start_login(connection: str, request: Request, plane: Plane, caller: Caller,
                      body: Annotated[LoginStart | None, Body()] = None) -> LoginOut:
    """Start a sign-in: ``code`` answers the authorization URL to open (the provider redirects to
    ``/v1/connections/callback``); ``device`` answers the user code and verification URI, then poll."""
    base = plane.settings.public_url or str(request.base_url)
    return await connections.start_login(plane, caller.tenant, connection, (body or LoginStart()).mode, base)


@router.post("/{connection}/logins/{login_id}/poll", response_model=LoginPollOut,
             responses=problems(400, 502))
async def poll_login(connection: str, login_id: str, plane: Plane, caller: Caller) -> LoginPollOut:
    """Ask the provider once whether the device sign-in was approved (wait ``interval`` between polls)."""
    return await connections.poll_device_login(plane, caller.tenant, connection, login_id)


@router.post("/{connection}/revoke", response_model=RevokeOut)
async def revoke(connection: str, plane: Plane, caller: Caller) -> RevokeOut:
    """Stop injection now on every node serving a session that binds it, and revoke at the provider."""
    return await connections.revoke_connection(plane, caller.tenant, connection)

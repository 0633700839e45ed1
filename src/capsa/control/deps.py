"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from capsa.control.auth import Principal, authenticate_cached, require_admin
from capsa.control.plane import ControlPlane
from capsa.control.schemas import ProblemDetail

__all__ = ["PROBLEMS", "Admin", "Caller", "Plane", "Scraper", "problems"]

_bearer = HTTPBearer(auto_error=False, description="An API key: `csk_<id>_<secret>`")


async def _plane(request: Request) -> ControlPlane:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop on every request.
    plane = request.app.state.plane
    assert isinstance(plane, ControlPlane)
    return plane


Plane = Annotated[ControlPlane, Depends(_plane)]


async def _caller(plane: Plane,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    return await authenticate_cached(plane.db, plane.keys, credentials.credentials if credentials else None)


Caller = Annotated[Principal, Depends(_caller)]


async def _admin(caller: Caller) -> Principal:
    return require_admin(caller)


Admin = Annotated[Principal, Depends(_admin)]


async def _scraper(plane: Plane,
                   credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """The metrics token (``CAPSA_METRICS_TOKEN``) or an admin API key."""
    given = credentials.credentials if credentials else None
    token = plane.settings.metrics_token
    if given and token is not None and hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        return
    require_admin(await authenticate_cached(plane.db, plane.keys, given))


Scraper = Annotated[None, Depends(_scraper)]

_DESCRIPTIONS = {
    401: "Missing, wrong or revoked API key (`unauthorized`)",
    403: "Admin key required (`forbidden`), or the tenant's quota is used up (`quota_exceeded`)",
    404: "Not found (`not_found`, `template_not_found`)",
    409: "Invalid state (`invalid_state`, `session_failed`)",
    413: "Payload too large (`payload_too_large`)",
    422: "Validation error (`validation_error`)",
    429: "Rate limited (`rate_limited`, see Retry-After)",
    503: "No capacity or node unreachable (`no_capacity`, `node_unreachable`)",
    400: "Bad request (`login_state_invalid`, `login_denied`)",
    502: "The OAuth provider refused or could not be reached (`provider_error`)",
    507: "The node's storage pool is at its free-space floor (`storage_full`)",
}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the given error statuses (always including 401 and 422)."""
    codes = sorted({401, 422, *statuses})
    return {code: {"model": ProblemDetail, "description": _DESCRIPTIONS[code],
                   "content": {"application/problem+json": {}}} for code in codes}


PROBLEMS = problems(404, 409, 429, 503)

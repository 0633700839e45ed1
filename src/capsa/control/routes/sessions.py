"""``/v1/sessions``: create, get, list, extend, close."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import ValidationFailed
from capsa.control.schemas import SessionCreate, SessionList, SessionOut, TimeoutUpdate
from capsa.control.sessions import audit as session_audit
from capsa.control.sessions import service as sessions

__all__ = ["router"]

router = APIRouter(prefix="/sessions", tags=["sessions"], responses=PROBLEMS)

_METADATA_PREFIX = "metadata."


@router.post("", status_code=201, response_model=SessionOut, responses=problems(403))
async def create_session(body: SessionCreate, plane: Plane, caller: Caller) -> SessionOut:
    """Create a session: rate limited per key (``rate_limited``, 429) and within the tenant's quota of
    sessions, vCPUs and memory (``quota_exceeded``, 403)."""
    await plane.rates.hit(plane.db, caller.key_id, "sessions", plane.settings.session_create_limit,
                          plane.settings.rate_window_seconds)
    out = await sessions.create_session(plane, caller, body)
    session_audit.created(out)
    return out


@router.get("", response_model=SessionList)
async def list_sessions(
    request: Request, plane: Plane, caller: Caller,
    state: Literal["creating", "running", "recovering", "paused", "closed", "failed"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> SessionList:
    # ``metadata.<key>=<value>`` filters have open-ended names, so they are read from the raw query.
    metadata: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name.startswith(_METADATA_PREFIX):
            key = name[len(_METADATA_PREFIX):]
            if not key or len(key) > 128 or "\x00" in value or len(value) > 4096:
                raise ValidationFailed("invalid metadata filter",
                                       [{"field": f"query.{name}", "message": "invalid metadata filter"}])
            metadata[key] = value
    return await sessions.list_sessions(plane, caller.tenant, state, metadata, limit, cursor)


@router.get("/{session_id}", response_model=SessionOut)
async def get_session(session_id: str, plane: Plane, caller: Caller) -> SessionOut:
    return await sessions.get_session(plane, caller.tenant, session_id)


@router.post("/{session_id}/timeout", response_model=SessionOut)
async def extend_timeout(session_id: str, body: TimeoutUpdate, plane: Plane, caller: Caller) -> SessionOut:
    out = await sessions.extend_session(plane, caller.tenant, session_id, body.timeout)
    session_audit.extended(out, body.timeout)
    return out


@router.post("/{session_id}/close", response_model=SessionOut)
async def close_session(session_id: str, plane: Plane, caller: Caller) -> SessionOut:
    return await sessions.close_session(plane, caller.tenant, session_id)


@router.delete("/{session_id}", response_model=SessionOut)
async def delete_session(session_id: str, plane: Plane, caller: Caller) -> SessionOut:
    return await sessions.close_session(plane, caller.tenant, session_id)

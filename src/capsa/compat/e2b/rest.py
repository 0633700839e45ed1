"""E2B's REST API (the part the ``e2b`` Python SDK calls) on capsa sessions.

An E2B sandbox is a capsa session: its ``sandboxID`` is the session id (``ses_…``), which stays the same
across pause and resume. Create maps the template, ``timeout`` (seconds, the session TTL), ``envVars``,
``metadata`` and ``autoPause`` (``on_timeout: pause``); connect resumes a paused session or extends a
running one's TTL; pause and resume are capsa's; kill closes the session. Errors are E2B's
``{"code": <HTTP status>, "message": …}``.
"""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capsa.compat.e2b import access_tokens
from capsa.compat.e2b.access import api_caller, plane
from capsa.compat.e2b.versions import ENVD_VERSION
from capsa.control.auth import Principal
from capsa.control.errors import InvalidState, NotFound
from capsa.control.plane import ControlPlane
from capsa.control.schemas import SessionCreate, SessionOut
from capsa.control.sessions import audit as session_audit
from capsa.control.sessions import service as sessions
from capsa.control.sessions import snapshots

__all__ = ["DEFAULT_TIMEOUT", "TEMPLATE_ALIASES", "capsa_template", "router"]

router = APIRouter()

DEFAULT_TIMEOUT = 300
"""E2B's default sandbox timeout (seconds), used when a create or connect names none."""
TEMPLATE_ALIASES = {"base": "base", "rki5dems9wqfm4r03t7g": "base"}
"""E2B template names and ids that mean capsa's ``base``; any other name is looked up as a capsa template."""
_CLIENT_ID = "capsa"
_LIVE = ("creating", "running", "recovering", "paused")

Caller = Annotated[tuple[Principal, str], Depends(api_caller)]


def capsa_template(template_id: str) -> str:
    return TEMPLATE_ALIASES.get(template_id, template_id)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NewSandbox(_Body):
    template_id: Annotated[str, Field(alias="templateID", min_length=1, max_length=128)]
    timeout: Annotated[int, Field(ge=1, le=86400)] = DEFAULT_TIMEOUT
    auto_pause: Annotated[bool, Field(alias="autoPause")] = False
    metadata: dict[str, str] | None = None
    env_vars: Annotated[dict[str, str] | None, Field(alias="envVars")] = None
    mcp: dict[str, Any] | None = None
    volume_mounts: Annotated[list[Any] | None, Field(alias="volumeMounts")] = None


class TimeoutBody(_Body):
    timeout: Annotated[int, Field(ge=0, le=86400)]


class ConnectBody(_Body):
    timeout: Annotated[int, Field(ge=0, le=86400)] = DEFAULT_TIMEOUT


def e2b_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _sandbox(out: SessionOut, token: str) -> dict[str, Any]:
    """E2B's ``Sandbox`` (create, connect, resume); ``token``: its envd access token (:func:`_token`)."""
    return {"templateID": out.template, "sandboxID": out.id, "clientID": _CLIENT_ID, "alias": out.template,
            "envdVersion": ENVD_VERSION, "envdAccessToken": token, "domain": None}


def _token(control: ControlPlane, principal: Principal, out: SessionOut) -> str:
    """The sandbox's ``envdAccessToken``: good for its own envd calls only, never the caller's API key."""
    return access_tokens.mint(control.settings, principal.key_id, out.id)


def _listed(out: SessionOut) -> dict[str, Any]:
    """E2B's ``ListedSandbox`` (``GET /sandboxes``, ``GET /v2/sandboxes``)."""
    return {"templateID": out.template, "sandboxID": out.id, "clientID": _CLIENT_ID, "alias": out.template,
            "startedAt": _iso(out.created_at), "endAt": _iso(out.expires_at), "cpuCount": out.vcpus,
            "memoryMB": out.memory_mib, "diskSizeMB": 0, "metadata": out.metadata,
            "state": "paused" if out.state == "paused" else "running", "envdVersion": ENVD_VERSION}


def _detail(out: SessionOut, token: str) -> dict[str, Any]:
    """E2B's ``SandboxDetail`` (``GET /sandboxes/{id}``)."""
    return {**_listed(out), "envdAccessToken": token, "domain": None, "allowInternetAccess": False,
            "lifecycle": {"onTimeout": "pause" if out.on_timeout == "pause" else "kill",
                          "autoResume": False}}


async def _live(control: ControlPlane, tenant: str, sandbox_id: str) -> SessionOut:
    """The session behind an E2B sandbox id; a closed or failed one is as gone as a missing one."""
    out = await sessions.get_session(control, tenant, sandbox_id)
    if out.state not in _LIVE:
        raise NotFound(f"sandbox {sandbox_id} not found")
    return out


@router.post("/sandboxes", status_code=201)
@router.post("/v2/sandboxes", status_code=201)
async def create_sandbox(request: Request, caller: Caller) -> Any:
    principal, _ = caller
    try:
        body = NewSandbox.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        return e2b_error(400, f"invalid request body: {exc}")
    if body.mcp:
        return e2b_error(400, "MCP servers in the sandbox are not supported by capsa")
    if body.volume_mounts:
        return e2b_error(400, "volume mounts are not supported by capsa")
    control = plane(request)
    try:
        create = SessionCreate(template=capsa_template(body.template_id), timeout=body.timeout,
                               env=body.env_vars or {}, metadata=body.metadata or {},
                               on_timeout="pause" if body.auto_pause else "close")
    except ValidationError as exc:
        return e2b_error(400, f"invalid sandbox settings: {exc.errors()[0]['msg']}")
    await _count_starts(control, principal)
    out = await sessions.create_session(control, principal, create)
    session_audit.created(out)
    return JSONResponse(_sandbox(out, _token(control, principal, out)), status_code=201)


def _metadata_filter(raw: str | None) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(raw, keep_blank_values=True)) if raw else {}


@router.get("/sandboxes")
async def list_running(request: Request, caller: Caller, metadata: str | None = None) -> Any:
    principal, _ = caller
    control = plane(request)
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:  # the v1 listing is not paged: every running sandbox
        page = await sessions.list_sessions(control, principal.tenant, "running", _metadata_filter(metadata),
                                            500, cursor)
        items.extend(_listed(s) for s in page.items)
        cursor = page.next_cursor
        if cursor is None:
            return items


@router.get("/v2/sandboxes")
async def list_sandboxes(
    request: Request, caller: Caller, metadata: str | None = None, state: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=512)] = None,
) -> Any:
    principal, _ = caller
    wanted: set[str] = set()
    for name in (state or "running,paused").split(","):
        if name.strip() not in ("running", "paused"):
            return e2b_error(400, f"unknown sandbox state {name!r}")
        wanted.add(name.strip())
    page = await sessions.list_sessions(plane(request), principal.tenant, sorted(wanted),
                                        _metadata_filter(metadata), limit, next_token)
    headers = {"X-Next-Token": page.next_cursor} if page.next_cursor else {}
    return JSONResponse([_listed(s) for s in page.items], headers=headers)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Any:
    principal, _ = caller
    control = plane(request)
    out = await _live(control, principal.tenant, sandbox_id)
    return _detail(out, _token(control, principal, out))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    principal, _ = caller
    control = plane(request)
    await _live(control, principal.tenant, sandbox_id)
    await sessions.close_session(control, principal.tenant, sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, request: Request, caller: Caller) -> Response:
    """E2B sets the time left from now (capsa: the session's TTL from now)."""
    principal, _ = caller
    control = plane(request)
    await _live(control, principal.tenant, sandbox_id)
    out = await sessions.extend_session(control, principal.tenant, sandbox_id, max(body.timeout, 1))
    session_audit.extended(out, max(body.timeout, 1))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, request: Request, caller: Caller) -> Response:
    principal, _ = caller
    await _live(plane(request), principal.tenant, sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    principal, _ = caller
    control = plane(request)
    out = await _live(control, principal.tenant, sandbox_id)
    if out.state == "paused":
        return e2b_error(409, f"sandbox {sandbox_id} is already paused")
    session_audit.paused(await snapshots.pause_session(control, principal.tenant, sandbox_id))
    return Response(status_code=204)


async def _count_starts(control: ControlPlane, principal: Principal, sandboxes: int = 1) -> None:
    """Starting sandboxes (create, resume, fork) spends the key's session rate limit, as on ``/v1``."""
    await control.rates.hit(control.db, principal.key_id, "sessions", control.settings.session_create_limit,
                            control.settings.rate_window_seconds, cost=sandboxes)


async def _resume_or_extend(control: ControlPlane, principal: Principal, sandbox_id: str,
                            ttl: int) -> tuple[SessionOut, bool]:
    out = await _live(control, principal.tenant, sandbox_id)
    resumed = False
    if out.state == "paused":
        await _count_starts(control, principal)
        out = await snapshots.resume_session(control, principal.tenant, sandbox_id)
        session_audit.resumed(out)
        resumed = True
    if out.state != "running":
        raise InvalidState(f"sandbox {sandbox_id} is {out.state}")
    if ttl > 0 and out.expires_at < datetime.now(UTC) + timedelta(seconds=ttl):
        out = await sessions.extend_session(control, principal.tenant, sandbox_id, ttl)
        session_audit.extended(out, ttl)
    return out, resumed


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_sandbox(sandbox_id: str, request: Request, caller: Caller,
                          body: ConnectBody | None = None) -> Any:
    """A running sandbox: 200 (its timeout extended to at least ``timeout``); a paused one is resumed: 201."""
    principal, _ = caller
    control = plane(request)
    out, resumed = await _resume_or_extend(control, principal, sandbox_id, (body or ConnectBody()).timeout)
    return JSONResponse(_sandbox(out, _token(control, principal, out)), status_code=201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume_sandbox(sandbox_id: str, request: Request, caller: Caller,
                         body: ConnectBody | None = None) -> Any:
    principal, _ = caller
    control = plane(request)
    out = await _live(control, principal.tenant, sandbox_id)
    if out.state != "paused":
        return e2b_error(409, f"sandbox {sandbox_id} is not paused")
    out, _ = await _resume_or_extend(control, principal, sandbox_id, (body or ConnectBody()).timeout)
    return JSONResponse(_sandbox(out, _token(control, principal, out)), status_code=201)


class ForkBody(_Body):
    timeout: Annotated[int | None, Field(ge=1, le=86400)] = None
    count: Annotated[int, Field(ge=1, le=32)] = 1


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork_sandbox(sandbox_id: str, request: Request, caller: Caller,
                       body: ForkBody | None = None) -> Any:
    """``count`` new sandboxes from the sandbox's state now: capsa's branch (a fresh snapshot of a running
    session, the latest of a paused one; the source keeps running with its id and expiry)."""
    principal, _ = caller
    control = plane(request)
    fork = body or ForkBody()
    await _live(control, principal.tenant, sandbox_id)
    await _count_starts(control, principal, fork.count)
    made = await snapshots.branch_session(control, principal.tenant, sandbox_id, fork.count)
    session_audit.branched(sandbox_id, made)
    results = []
    for out in made.items:
        if fork.timeout is not None:
            out = await sessions.extend_session(control, principal.tenant, out.id, fork.timeout)
            session_audit.extended(out, fork.timeout)
        results.append({"sandbox": _sandbox(out, _token(control, principal, out))})
    return JSONResponse(results, status_code=201)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, request: Request, caller: Caller) -> Any:
    """capsa keeps no usage time series: an existing sandbox answers an empty list."""
    principal, _ = caller
    await _live(plane(request), principal.tenant, sandbox_id)
    return []


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def not_served(rest: str, request: Request) -> JSONResponse:
    """The rest of E2B's API (templates, snapshots, fork, logs, network updates, volumes, secrets): 501,
    which the SDK raises as ``SandboxException("501: …")`` (a plain 404 would read as a missing sandbox)."""
    return e2b_error(501, f"{request.method} /{rest} is not supported by capsa's E2B layer (docs/e2b.md)")

"""``/v1/sessions/{id}``: pause, resume, branch, snapshots (list, take), restore to a snapshot."""

from __future__ import annotations

from fastapi import APIRouter

from capsa.control.audit import trail as audit_trail
from capsa.control.auth import Principal
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.schemas import (
    BranchOut,
    BranchRequest,
    RestoreRequest,
    SessionOut,
    SnapshotCreate,
    SnapshotList,
    SnapshotOut,
)
from capsa.control.sessions import audit as session_audit
from capsa.control.sessions import snapshots

__all__ = ["router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["snapshots"], responses=PROBLEMS)


async def _count_start(plane: Plane, caller: Principal, sandboxes: int = 1) -> None:
    """Resume, restore and branch start sandboxes as create does: the same per-key rate limit."""
    await plane.rates.hit(plane.db, caller.key_id, "sessions", plane.settings.session_create_limit,
                          plane.settings.rate_window_seconds, cost=sandboxes)


@router.post("/pause", response_model=SessionOut, responses=problems(403, 507))
async def pause_session(session_id: str, plane: Plane, caller: Caller) -> SessionOut:
    """Snapshot the session and destroy its sandbox (state ``paused``); within the tenant's paused-session
    and snapshot quotas (``quota_exceeded``)."""
    out = await snapshots.pause_session(plane, caller.tenant, session_id)
    session_audit.paused(out)
    return out


@router.post("/resume", response_model=SessionOut, responses=problems(403, 507))
async def resume_session(session_id: str, plane: Plane, caller: Caller) -> SessionOut:
    """Start a new sandbox from the paused session's latest snapshot (state ``running``); within the
    tenant's quota (``quota_exceeded``)."""
    await _count_start(plane, caller)
    out = await snapshots.resume_session(plane, caller.tenant, session_id)
    session_audit.resumed(out)
    return out


@router.post("/branch", status_code=201, response_model=BranchOut, responses=problems(403, 507))
async def branch_session(session_id: str, body: BranchRequest, plane: Plane, caller: Caller) -> BranchOut:
    """``n`` new sessions from this session's current state (a running session is snapshotted first);
    they count ``n`` against the rate limit and must fit the tenant's quota (``quota_exceeded``)."""
    await _count_start(plane, caller, body.n)
    out = await snapshots.branch_session(plane, caller.tenant, session_id, body.n)
    session_audit.branched(session_id, out)
    return out


@router.get("/snapshots", response_model=SnapshotList)
async def list_snapshots(session_id: str, plane: Plane, caller: Caller) -> SnapshotList:
    return await snapshots.list_snapshots(plane, caller.tenant, session_id)


@router.post("/snapshots", status_code=201, response_model=SnapshotOut, responses=problems(403, 507))
async def take_snapshot(session_id: str, plane: Plane, caller: Caller,
                        body: SnapshotCreate | None = None) -> SnapshotOut:
    """Snapshot the running session now; it keeps running. At most ``snapshot_limit`` per API key per
    rate window (``rate_limited``), within the tenant's snapshot quota (``quota_exceeded``) and the
    node's free-space floor (``storage_full``, 507)."""
    await plane.rates.hit(plane.db, caller.key_id, "snapshots", plane.settings.snapshot_limit,
                          plane.settings.rate_window_seconds)
    out = await snapshots.take_snapshot(plane, caller.tenant, session_id)
    audit_trail.note("session", "snapshot", session_id=session_id, detail={"snapshot_id": out.id})
    return out


@router.post("/restore", response_model=SessionOut, responses=problems(507))
async def restore_session(session_id: str, body: RestoreRequest, plane: Plane, caller: Caller) -> SessionOut:
    """Roll the session back to one of its snapshots (a new sandbox replaces the current one)."""
    await _count_start(plane, caller)
    out = await snapshots.restore_session(plane, caller.tenant, session_id, body.snapshot_id)
    audit_trail.note("session", "restore", session_id=session_id, detail={"snapshot_id": body.snapshot_id})
    return out

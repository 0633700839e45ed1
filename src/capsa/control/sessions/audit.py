"""The ``session`` events of the tenant audit chain, noted on the current API request: one place for what
each lifecycle call records, so every front end (``/v1``, the E2B dialect) writes the same events."""

from __future__ import annotations

from capsa.control.audit import trail as audit_trail
from capsa.control.schemas import BranchOut, SessionOut

__all__ = ["branched", "created", "extended", "paused", "resumed", "session_detail"]


def session_detail(out: SessionOut) -> dict[str, object]:
    return {"state": out.state, "template": out.template, "vcpus": out.vcpus, "memory_mib": out.memory_mib,
            "node_id": out.node_id, "expires_at": out.expires_at.isoformat()}


def created(out: SessionOut) -> None:
    audit_trail.note("session", "create", session_id=out.id, detail=session_detail(out))


def extended(out: SessionOut, timeout: int) -> None:
    audit_trail.note("session", "extend", session_id=out.id,
                     detail={"timeout": timeout, "expires_at": out.expires_at.isoformat()})


def paused(out: SessionOut) -> None:
    audit_trail.note("session", "pause", session_id=out.id, detail={"state": out.state})


def resumed(out: SessionOut) -> None:
    audit_trail.note("session", "resume", session_id=out.id,
                     detail={"state": out.state, "node_id": out.node_id})


def branched(session_id: str, out: BranchOut) -> None:
    """The source's ``branch`` event and a ``create`` for each new session."""
    audit_trail.note("session", "branch", session_id=session_id,
                     detail={"snapshot_id": out.snapshot_id, "branches": [s.id for s in out.items]})
    for branch in out.items:
        audit_trail.note("session", "create", session_id=branch.id,
                         detail={"state": branch.state, "branched_from": session_id,
                                 "snapshot_id": out.snapshot_id})

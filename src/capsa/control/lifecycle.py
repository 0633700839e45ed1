"""Session states and the only transitions allowed between them.

Every state change is a conditional ``UPDATE … WHERE state IN (allowed sources)`` so that two replicas (or
the reaper and a user) racing on one session cannot both win: exactly one caller sees ``True``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["ACTIVE_STATES", "LEGAL_TRANSITIONS", "TERMINAL_STATES", "transition"]

LEGAL_TRANSITIONS: dict[str, frozenset[str]] = {
    "creating": frozenset({"running", "failed", "closed"}),
    "running": frozenset({"paused", "closed", "failed"}),
    "paused": frozenset({"running", "closed", "failed"}),
    "closed": frozenset(),
    "failed": frozenset(),
}
TERMINAL_STATES = frozenset({"closed", "failed"})
ACTIVE_STATES = frozenset({"creating", "running"})
"""States in which a session holds (or is about to hold) a sandbox on its node."""


async def transition(db: DbSession, session_id: str, target: str, **fields: Any) -> bool:
    """Move a session to ``target`` if its current state allows it; returns whether this call did it."""
    sources = [state for state, targets in LEGAL_TRANSITIONS.items() if target in targets]
    now = utcnow()
    values: dict[str, Any] = {"state": target, "updated_at": now, **fields}
    if target in TERMINAL_STATES:
        values.setdefault("closed_at", now)
    result = await db.execute(
        update(SessionRow).where(SessionRow.id == session_id, SessionRow.state.in_(sources)).values(**values)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]

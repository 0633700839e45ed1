"""Session states and the only transitions allowed between them.

Every state change is a conditional ``UPDATE … WHERE state IN (allowed sources)`` so that two replicas (or
the reaper and a user) racing on one session cannot both win: exactly one caller sees ``True``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import update

from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["ACTIVE_STATES", "LEGAL_TRANSITIONS", "TERMINAL_STATES", "transition"]

LEGAL_TRANSITIONS: dict[str, frozenset[str]] = {
    # creating -> paused: a resume (or restore) whose new sandbox could not be started falls back.
    "creating": frozenset({"running", "paused", "failed", "closed"}),
    # running -> creating: restore to an earlier snapshot swaps in a new sandbox; running -> recovering: its
    # node died and a stored snapshot is being restored on another (sessions/recovery.py).
    "running": frozenset({"creating", "recovering", "paused", "closed", "failed"}),
    "recovering": frozenset({"running", "paused", "closed", "failed"}),
    # paused -> creating: resume is starting a sandbox from the latest snapshot.
    "paused": frozenset({"creating", "running", "closed", "failed"}),
    "closed": frozenset(),
    "failed": frozenset(),
}
TERMINAL_STATES = frozenset({"closed", "failed"})
ACTIVE_STATES = frozenset({"creating", "running", "recovering"})
"""States in which a session holds (or is about to hold) a sandbox on its node."""


async def transition(db: DbSession, session_id: str, target: str, *, sources: Iterable[str] | None = None,
                     **fields: Any) -> bool:
    """Move a session to ``target`` if its current state allows it; returns whether this call did it.

    ``sources`` narrows the states this call may start from (each must be a legal source of ``target``).
    """
    legal = [state for state, targets in LEGAL_TRANSITIONS.items() if target in targets]
    if sources is not None:
        wanted = set(sources)
        if not wanted <= set(legal):
            raise ValueError(f"illegal transition {sorted(wanted - set(legal))} -> {target}")
        legal = [state for state in legal if state in wanted]
    now = utcnow()
    values: dict[str, Any] = {"state": target, "updated_at": now, **fields}
    if target in TERMINAL_STATES:
        values.setdefault("closed_at", now)
    result = await db.execute(
        update(SessionRow).where(SessionRow.id == session_id, SessionRow.state.in_(legal)).values(**values)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]

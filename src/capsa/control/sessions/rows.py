"""A tenant's session row, read fresh in the caller's transaction (to change it or what hangs off it).

The one rule for reading a session on a caller's behalf: another tenant's session is indistinguishable from
a missing one (404 ``not_found``). Calls on a running session's sandbox take :func:`relay.running
<capsa.control.sessions.relay.running>`, which reads the session with its node (and may take it from the
session cache)."""

from __future__ import annotations

from capsa.common import logs
from capsa.common.ids import is_id
from capsa.control.errors import NotFound
from capsa.control.store.db import DbSession
from capsa.control.store.models import SessionRow

__all__ = ["load_session"]


async def load_session(db: DbSession, tenant: str, session_id: str) -> SessionRow:
    """The session ``session_id`` of ``tenant``, in any state; NotFound when it is missing or another's.
    Found, the rest of the request logs its ``session_id``."""
    row = await db.get(SessionRow, session_id, populate_existing=True) if is_id(session_id, "ses") else None
    if row is None or row.tenant != tenant:
        raise NotFound(f"session {session_id} not found")
    logs.bind(session_id=row.id)
    return row

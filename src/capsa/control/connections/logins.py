"""Purging finished sign-ins: a ``connection_logins`` row (a sealed PKCE verifier or device code) is of
no use once it expired, so the reaper deletes it an hour after its expiry (the hour lets a late poll of a
device sign-in still be told ``expired`` rather than "unknown")."""

from __future__ import annotations

import time

from sqlalchemy import delete

from capsa.control.plane import ControlPlane
from capsa.control.store.connection_models import ConnectionLoginRow

__all__ = ["LOGIN_GRACE_SECONDS", "purge_logins"]

LOGIN_GRACE_SECONDS = 3600.0


async def purge_logins(plane: ControlPlane, now: float | None = None) -> int:
    """Delete sign-ins that expired more than :data:`LOGIN_GRACE_SECONDS` ago; returns how many. A plain
    conditional DELETE: replicas running it at once delete each row once between them."""
    cutoff = (time.time() if now is None else now) - LOGIN_GRACE_SECONDS
    async with plane.db() as db:
        done = await db.execute(delete(ConnectionLoginRow).where(ConnectionLoginRow.expires_at < cutoff))
        await db.commit()
    return int(done.rowcount)  # type: ignore[attr-defined]  # CursorResult of a DELETE

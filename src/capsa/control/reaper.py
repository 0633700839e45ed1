"""The reaper: closes sessions past their TTL or idle timeout and fails sessions on silent nodes.

It reads everything from the database on every pass, so it picks up where it left off after a restart and
several replicas can run it at once (state changes are conditional updates; exactly one replica wins each).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from sqlalchemy import select

from capsa.control import ratelimit
from capsa.control.nodes import fail_silent_nodes
from capsa.control.plane import ControlPlane
from capsa.control.sessions import fail_session, finish_session, sessions_to_expire
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["reap_once", "run_reaper"]

log = logging.getLogger(__name__)

# A session still "creating" after this long lost its creator (e.g. a replica crashed mid-boot).
_STUCK_CREATING = timedelta(minutes=15)


async def reap_once(plane: ControlPlane) -> dict[str, list[str]]:
    """One pass; returns what it did (session ids per action)."""
    async with plane.db() as db:
        due = await sessions_to_expire(db)
        stuck = list((await db.execute(select(SessionRow.id).where(
            SessionRow.state == "creating", SessionRow.created_at < utcnow() - _STUCK_CREATING))).scalars())
    closed = [sid for sid, reason in due if await finish_session(plane, sid, "closed", reason)]
    failed = await fail_silent_nodes(plane)
    failed += [sid for sid in stuck if await fail_session(plane, sid, "sandbox creation never finished")]
    async with plane.db() as db:
        await ratelimit.prune(db, time.time() - 2 * plane.settings.rate_window_seconds)
    return {"closed": closed, "failed": failed}


async def run_reaper(plane: ControlPlane) -> None:
    interval = plane.settings.reaper_interval
    while True:
        try:
            done = await reap_once(plane)
            if done["closed"] or done["failed"]:
                log.info("reaper closed %s failed %s", done["closed"], done["failed"])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reaper pass failed; retrying next interval")
        await asyncio.sleep(interval)

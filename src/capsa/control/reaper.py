"""The reaper: closes sessions past their TTL or idle timeout, fails sessions on silent nodes, and purges
audit events past their retention (the egress trail, and the tenant chain behind signed checkpoints) and
expired sign-ins.

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
from capsa.control.audit.chain_retention import purge_chain
from capsa.control.audit.egress_retention import purge_audit
from capsa.control.connections.logins import purge_logins
from capsa.control.nodes.registry import fail_silent_nodes
from capsa.control.plane import ControlPlane
from capsa.control.sessions.service import fail_session, finish_session, purge_snapshots, sessions_to_expire
from capsa.control.sessions.snapshots import prune_aged_rolling, reap_to_pause
from capsa.control.store.models import SessionRow, utcnow
from capsa.control.store_collect import collect_store

__all__ = ["reap_once", "run_reaper"]

log = logging.getLogger(__name__)

# A session still "creating" or "recovering" this long after it entered that state (a first boot, a resume,
# a recovery) lost its creator (e.g. a replica crashed mid-boot).
_STUCK_CREATING = timedelta(minutes=15)


async def reap_once(plane: ControlPlane) -> dict[str, list[str]]:
    """One pass; returns what it did (session ids per action)."""
    async with plane.db() as db:
        due = await sessions_to_expire(db, plane.settings.activity_stamp_interval)
        stuck = list((await db.execute(select(SessionRow.id).where(
            SessionRow.state.in_(("creating", "recovering")),
            SessionRow.updated_at < utcnow() - _STUCK_CREATING))).scalars())
        pausing = set((await db.execute(select(SessionRow.id).where(
            SessionRow.id.in_([sid for sid, _ in due]), SessionRow.state == "running",
            SessionRow.on_timeout == "pause"))).scalars()) if due else set()
    # on_timeout=pause: keep a snapshot instead of closing (a sandbox already gone is paused or failed).
    paused = [sid for sid, reason in due if sid in pausing and await reap_to_pause(plane, sid, reason)]
    closed = [sid for sid, reason in due
              if sid not in pausing and await finish_session(plane, sid, "closed", reason)]
    failed = await fail_silent_nodes(plane)
    failed += [sid for sid in stuck if await fail_session(plane, sid, "sandbox creation never finished")]
    async with plane.db() as db:
        await ratelimit.prune(db, time.time() - 2 * plane.settings.rate_window_seconds)
    await purge_snapshots(plane)
    await purge_audit(plane)
    await purge_chain(plane)
    await purge_logins(plane)
    await prune_aged_rolling(plane)
    await collect_store(plane)
    for action, done in (("closed", closed), ("failed", failed), ("paused", paused)):
        if done:
            plane.metrics.reaped.labels(action).inc(len(done))
    return {"closed": closed, "failed": failed, "paused": paused}


async def run_reaper(plane: ControlPlane) -> None:
    interval = plane.settings.reaper_interval
    while True:
        try:
            done = await reap_once(plane)
            if done["closed"] or done["failed"] or done["paused"]:
                log.info("reaper closed %s failed %s paused %s", done["closed"], done["failed"],
                         done["paused"])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reaper pass failed; retrying next interval")
        await asyncio.sleep(interval)

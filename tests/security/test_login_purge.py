"""Issue 27 (low): sign-in rows (``connection_logins``: a sealed PKCE verifier or device code each) were
never purged, so every abandoned sign-in stayed in the database for good. The reaper now deletes those
that expired more than an hour ago and keeps the rest. On SQLite and PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select

from capsa.control.connections.logins import LOGIN_GRACE_SECONDS, purge_logins
from capsa.control.plane import ControlPlane
from capsa.control.reaper import reap_once
from capsa.control.settings import ControlSettings
from capsa.control.store.connection_models import ConnectionLoginRow, ConnectionProviderRow, ConnectionRow
from capsa.control.store.db import create_engine, migrate, session_factory
from capsa.control.store.models import utcnow

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgresql]


async def test_expired_sign_ins_are_purged_and_live_ones_kept(db_url: str, tmp_path: Path) -> None:
    engine = create_engine(db_url)
    try:
        await migrate(engine)
        plane = ControlPlane(settings=ControlSettings(database_url=db_url), engine=engine,
                             db=session_factory(engine))
        now = time.time()
        ages = {"lgn_live": now + 600, "lgn_just_expired": now - 60,
                "lgn_abandoned": now - LOGIN_GRACE_SECONDS - 60, "lgn_ancient": now - 86400 * 30}
        async with plane.db() as db:
            db.add(ConnectionProviderRow(id="cpr_1", tenant="acme", name="idp", token_endpoint="https://idp/t",
                                         client_id="c", scopes=[], created_at=utcnow()))
            db.add(ConnectionRow(id="con_1", tenant="acme", name="gh", provider_id="cpr_1", state="pending",
                                 created_at=utcnow()))
            await db.flush()
            for login_id, expires in ages.items():
                db.add(ConnectionLoginRow(id=login_id, kind="device", tenant="acme", connection_id="con_1",
                                          secret=b"sealed", expires_at=expires, interval=5.0))
            await db.commit()
        assert await reap_once(plane) is not None  # the reaper's pass purges them
        async with plane.db() as db:
            left = set((await db.execute(select(ConnectionLoginRow.id))).scalars())
        assert left == {"lgn_live", "lgn_just_expired"}
        assert await purge_logins(plane, now=now + 600 + LOGIN_GRACE_SECONDS + 1) == 2
    finally:
        await engine.dispose()

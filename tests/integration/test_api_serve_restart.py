"""Restarting ``capsa serve`` (real process, real VMs): session records survive; stopping it fails the
sessions it ran (they had no snapshot) with the reason, at once rather than at the next start; and the new
process's reaper closes expired sessions and destroys their VMs."""

from __future__ import annotations

import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from capsa.control.keys import generate_key
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.processes import qemu_pids
from tests.support.served import start_serve

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def _session(client: httpx.Client, sid: str) -> dict[str, object]:
    response = client.get(f"/v1/sessions/{sid}")
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def test_restart_keeps_records_and_reaper_still_closes_expired_sessions() -> None:
    work = Path(tempfile.mkdtemp(prefix="capsa-rst-"))
    work.chmod(0o755)
    state = work / "state"
    admin = generate_key().full
    try:
        first = start_serve(state, work, env={"CAPSA_BOOTSTRAP_KEY": admin})
        try:
            with httpx.Client(
                base_url=first.url, headers={"Authorization": f"Bearer {admin}"}, timeout=300
            ) as c:
                long = c.post("/v1/sessions", json={"timeout": 3600, "metadata": {"name": "long"}}).json()
                short = c.post("/v1/sessions", json={"timeout": 20, "metadata": {"name": "short"}}).json()
                assert long["state"] == short["state"] == "running"
                assert len(qemu_pids(state)) == 2
        finally:
            assert first.stop() == 0, first.stderr.read_text()[-2000:]
        assert wait_no_vm_leftovers(state) == []  # stopping serve destroyed its VMs
        # Let the short session's TTL pass while nothing runs: the reaper must leave a failed session failed.
        expires = datetime.fromisoformat(str(short["expires_at"]))
        time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds() + 1))

        second = start_serve(state, work, env={"CAPSA_BOOTSTRAP_KEY": admin})
        try:
            with httpx.Client(
                base_url=second.url, headers={"Authorization": f"Bearer {admin}"}, timeout=300
            ) as c:
                kept_long, kept_short = _session(c, long["id"]), _session(c, short["id"])
                assert (
                    kept_long["metadata"] == {"name": "long"}
                    and kept_long["created_at"] == long["created_at"]
                )
                for kept in (kept_long, kept_short):  # both were running when the node stopped
                    assert (kept["state"], kept["failure_reason"]) == ("failed", "node_lost"), kept
                listed = {s["id"] for s in c.get("/v1/sessions").json()["items"]}
                assert {long["id"], short["id"]} <= listed

                fresh = c.post("/v1/sessions", json={"timeout": 3}).json()
                assert fresh["state"] == "running" and len(qemu_pids(state)) == 1
                deadline = time.monotonic() + 60
                while _session(c, fresh["id"])["state"] != "closed" and time.monotonic() < deadline:
                    time.sleep(0.5)
                reaped = _session(c, fresh["id"])
                assert reaped["state"] == "closed" and reaped["failure_reason"] == "timeout"
                assert wait_no_vm_leftovers(state) == []
        finally:
            assert second.stop() == 0, second.stderr.read_text()[-2000:]
        assert "bootstrap admin key" not in second.printed()
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)

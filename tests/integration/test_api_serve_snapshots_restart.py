"""Sessions outlive a ``capsa serve`` restart (real process, real VMs): a session with a rolling snapshot
and a paused session are both resumable by the new process, with their files; closing them afterwards
deletes their snapshot files and leaves no VM."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.control.keys import generate_key
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.processes import qemu_pids
from tests.support.served import start_serve

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def _sh(c: httpx.Client, sid: str, cmd: str) -> str:
    result = _ok(c.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd, "timeout": 60}))
    assert result["exit_code"] == 0, result
    return str(result["stdout"])


def _until(what: str, check: Any, limit: float = 90.0) -> Any:
    deadline = time.monotonic() + limit
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def _snapshot_files(state: Path) -> set[str]:
    root = state / "storage" / "pool" / "snapshots"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_sessions_with_snapshots_survive_a_serve_restart() -> None:
    work = Path(tempfile.mkdtemp(prefix="capsa-srs-"))
    work.chmod(0o755)
    state = work / "state"
    admin = generate_key().full
    headers = {"Authorization": f"Bearer {admin}"}
    try:
        first = start_serve(state, work, env={"CAPSA_BOOTSTRAP_KEY": admin})
        try:
            with httpx.Client(base_url=first.url, headers=headers, timeout=300) as c:
                rolling = _ok(c.post("/v1/sessions", json={
                    "timeout": 3600, "rolling_snapshots": {"after_command": True, "keep": 2}}), 201)["id"]
                _sh(c, rolling, "echo rolled > /root/r")
                _until("a rolling snapshot", lambda: _ok(c.get(f"/v1/sessions/{rolling}/snapshots"))["items"])
                paused = _ok(c.post("/v1/sessions", json={"timeout": 3600}), 201)["id"]
                _sh(c, paused, "echo held > /root/p")
                assert _ok(c.post(f"/v1/sessions/{paused}/pause"))["state"] == "paused"
                plain = _ok(c.post("/v1/sessions", json={"timeout": 3600}), 201)["id"]
                snapshot_ids = {s["id"] for sid in (rolling, paused)
                                for s in _ok(c.get(f"/v1/sessions/{sid}/snapshots"))["items"]}
                assert snapshot_ids <= _snapshot_files(state)
        finally:
            assert first.stop() == 0, first.stderr.read_text()[-2000:]
        assert wait_no_vm_leftovers(state) == []  # the VMs died with the process (the pool is unmounted)

        second = start_serve(state, work, env={"CAPSA_BOOTSTRAP_KEY": admin})
        try:
            with httpx.Client(base_url=second.url, headers=headers, timeout=300) as c:
                def state_of(sid: str) -> dict[str, Any]:
                    return dict(_ok(c.get(f"/v1/sessions/{sid}")))

                # The node re-registers just after the API comes up; its lost sandboxes are handled then.
                info = _until("the rolling session to be paused",
                              lambda: (s := state_of(rolling))["state"] == "paused" and s)
                assert "node stopped" in info["pause_reason"]
                assert snapshot_ids <= _snapshot_files(state)  # the snapshots outlived the process
                assert _until("the plain session to fail", lambda: state_of(plain)["state"] == "failed")
                assert state_of(paused)["state"] == "paused"
                for sid, path, text in ((rolling, "/root/r", "rolled\n"), (paused, "/root/p", "held\n")):
                    assert _ok(c.post(f"/v1/sessions/{sid}/resume"))["state"] == "running"
                    assert _sh(c, sid, f"cat {path}") == text
                assert len(qemu_pids(state)) == 2
                for sid in (rolling, paused):
                    _ok(c.post(f"/v1/sessions/{sid}/close"))
                assert not (snapshot_ids & _snapshot_files(state))
                assert wait_no_vm_leftovers(state) == []
        finally:
            assert second.stop() == 0, second.stderr.read_text()[-2000:]
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)

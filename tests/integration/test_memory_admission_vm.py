"""A node admits sessions by the memory it really has: ``capsa serve`` under a memory cgroup limit (a pod's
or a unit's) takes sessions until what is left would fall under its reserve, then refuses the next one with
``no_capacity``, and the OOM killer never runs; a session closed gives the room back."""

from __future__ import annotations

import time

import httpx
import pytest

from capsa.control.keys import generate_key
from tests.support.memory_cgroup import memory_cgroup
from tests.support.problems import assert_problem
from tests.support.served import serve_workdir, start_serve

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

LIMIT_MIB = 1280
RESERVE_MIB = 192
MAX_SESSIONS = 30  # bound: 1280 MiB cannot hold this many (each takes ~80 MiB, the server ~250 MiB)


def _true(client: httpx.Client, sid: str) -> None:
    response = client.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
    assert response.status_code == 200, response.text
    assert response.json()["exit_code"] == 0


def test_a_node_under_a_memory_limit_refuses_sessions_before_it_runs_out_and_nothing_is_oom_killed() -> None:
    admin = generate_key().full
    with memory_cgroup(LIMIT_MIB) as cgroup, serve_workdir("capsa-mem-") as work:
        served = start_serve(work / "state", work, prefix=cgroup.prefix, env={
            "CAPSA_BOOTSTRAP_KEY": admin, "CAPSA_NODE_MEMORY_RESERVE_MIB": str(RESERVE_MIB)})
        try:
            with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {admin}"},
                              timeout=300) as client:
                made: list[str] = []
                refused = None
                while len(made) < MAX_SESSIONS:
                    response = client.post("/v1/sessions", json={"timeout": 600})
                    if response.status_code != 201:
                        refused = response
                        break
                    made.append(response.json()["id"])
                    _true(client, made[-1])
                assert refused is not None, f"{len(made)} sessions fit under {LIMIT_MIB} MiB"
                problem = assert_problem(refused, 503, "no_capacity")
                assert "short of memory" in problem["detail"], problem
                assert len(made) >= 3, problem
                print(f"{len(made)} sessions admitted; refused: {problem['detail']}")
                # Nothing was killed: every admitted session still runs, and no half-made one is listed.
                assert cgroup.oom_kills() == 0
                for sid in made:
                    _true(client, sid)
                listed = {s["id"]: s["state"] for s in client.get("/v1/sessions").json()["items"]}
                assert listed == dict.fromkeys(made, "running")
                # The node reports what its sandboxes really hold (its next heartbeat).
                deadline = time.monotonic() + 60
                while (used := client.get("/v1/nodes").json()["items"][0]["used"]).get(
                        "memory_pss_mib", 0) <= 0 and time.monotonic() < deadline:
                    time.sleep(1)
                assert used["memory_pss_mib"] > 0, used
                assert used["memory_available_mib"] < LIMIT_MIB, used
                # Closing sessions gives their memory back: one more fits again.
                for sid in made[:2]:
                    assert client.delete(f"/v1/sessions/{sid}").status_code in (200, 204)
                again = client.post("/v1/sessions", json={"timeout": 600})
                assert again.status_code == 201, again.text
                _true(client, again.json()["id"])
                assert cgroup.oom_kills() == 0
        finally:
            assert served.stop() == 0, served.errors()

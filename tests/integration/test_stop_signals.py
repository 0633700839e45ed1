"""``capsa serve`` stopped by SIGTERM (systemd, Kubernetes, ``kill``) or SIGINT (Ctrl-C) while sessions run
and a warm pool holds idle VMs: it exits 0 and leaves no QEMU process, mount, loop device, namespace or
temporary file; on the next start, the session it held is paused (it had a snapshot) or failed (none)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.sdk import AsyncClient, AsyncSession
from tests.support.leftovers import wait_no_node_leftovers
from tests.support.processes import qemu_pids
from tests.support.served import serve_workdir, start_serve

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.timeout(900)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with serve_workdir("capsa-sig-") as path:
        yield path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_stop_signal_leaves_nothing_and_sessions_are_paused_or_failed(workdir: Path,
                                                                            sig: signal.Signals) -> None:
    state = workdir / "state"
    served = start_serve(state, workdir, env={"CAPSA_POOL_SIZE": "1", "CAPSA_BOOTSTRAP_KEY": ""})
    try:
        key = served.bootstrap_key()
        client = AsyncClient(served.url, key)
        kept = await AsyncSession.create(timeout=600, client=client)
        await kept.files.write("/root/kept.txt", "kept")
        await kept.snapshots.create()
        plain = await AsyncSession.create(timeout=600, client=client)
        assert (await plain.commands.run("echo hi", timeout=60)).stdout == "hi\n"
        assert qemu_pids(state), "the sessions' VMs (and the pool's) should be running"
        await client.aclose()
    finally:
        code = served.stop(sig, timeout=120)
    assert code == 0, served.errors()
    left = wait_no_node_leftovers(state, timeout=60)
    assert left == [], left

    again = start_serve(state, workdir)
    try:
        client = AsyncClient(again.url, key)
        states = {s: (await client.get_session(s)).state for s in (kept.id, plain.id)}
        await client.aclose()
    finally:
        assert again.stop(sig, timeout=120) == 0, again.errors()
    assert states[plain.id] == "failed", states
    assert states[kept.id] == "paused", states
    left = wait_no_node_leftovers(state, timeout=60)
    assert left == [], left

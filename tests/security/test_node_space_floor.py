"""Issue 27, M4: a node keeps a free-space floor on its storage pool.

One tenant's snapshots filled a node's shared pool and every tenant then got ENOSPC. Here the node's real
storage pool is a small loop-mounted btrfs (:class:`~capsa.node.storage.pool.StoragePool`, as a node mounts
its own), the fake runtime keeps its sandboxes and snapshots on it, and a tenant fills it for real with
snapshots of incompressible data, through the control plane over HTTP. The node refuses the snapshot that
could cross the floor, and a restore, with ``storage_full`` (507, problem+json) before writing anything:
the pool keeps its floor, no half-made snapshot is left, the session runs on, and closing it gives the
space back.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.node.storage import StoragePool
from capsa.node.storage.floor import SpaceFloor
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.vm import searchable_dir, snapshot_pool

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="a loop btrfs and the fake runtime's snapshots need root"),
]

MiB = 1024 * 1024
POOL_MIB = 320
FLOOR_MIB = 48
BLOB_MIB = 24
MEMORY_MIB = 64


@pytest.fixture
def tiny_pool() -> Iterator[StoragePool]:
    # Outside /tmp and /var/tmp, which a confined fake guest sees as its own tmpfs.
    with searchable_dir("capsa-floor-", parent="/run", mode=0o755) as state, \
            snapshot_pool(state, loop_size_mib=POOL_MIB) as pool:
        yield pool


@pytest.fixture
async def stack(tiny_pool: StoragePool, tmp_path: Path) -> AsyncIterator[ApiStack]:
    runtime = FakeRuntime(tiny_pool.root / "fake")
    floor = SpaceFloor(tiny_pool.free_bytes, FLOOR_MIB * MiB)
    stack = ApiStack(f"sqlite+aiosqlite:///{tmp_path / 'capsa.db'}", runtime, fake_image(tmp_path / "image"),
                     snapshot_floor=floor)
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()  # also the agent and its runtime: nothing of theirs is left on the pool


async def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def _storage_full(response: httpx.Response) -> str:
    assert response.status_code == 507, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == "storage_full", body
    return str(body["detail"])


async def test_the_node_refuses_snapshots_and_restores_below_its_free_space_floor(
        stack: ApiStack, tiny_pool: StoragePool) -> None:
    assert isinstance(stack.runtime, FakeRuntime)
    runtime = stack.runtime
    async with stack.client(await stack.tenant_key("greedy")) as g:
        sid = (await _ok(await g.post("/v1/sessions", json={"memory_mib": MEMORY_MIB}), 201))["id"]
        ran = await _ok(await g.post(f"/v1/sessions/{sid}/commands", json={
            "cmd": f"head -c {BLOB_MIB * MiB} /dev/urandom > /tmp/blob"}))
        assert ran["exit_code"] == 0, ran

        taken: list[str] = []
        refusal = None
        for _ in range(POOL_MIB // BLOB_MIB + 1):  # more than the pool can hold
            free_before = tiny_pool.free_bytes()
            response = await g.post(f"/v1/sessions/{sid}/snapshots")
            if response.status_code != 201:
                refusal = response
                break
            taken.append(response.json()["id"])
        assert refusal is not None, f"{len(taken)} snapshots and no refusal"
        detail = _storage_full(refusal)
        assert "CAPSA_STORAGE_MIN_FREE_MIB" in detail
        # Refused before writing: where the floor would be crossed by what a snapshot may write, with
        # the pool still above its floor; the snapshots taken before were real (the pool filled up).
        assert free_before - MEMORY_MIB * MiB < FLOOR_MIB * MiB <= tiny_pool.free_bytes()
        assert len(taken) >= 2
        print(f"\n{len(taken)} snapshots of {BLOB_MIB} MiB, then storage_full with "
              f"{tiny_pool.free_bytes() // MiB} MiB free of a {POOL_MIB} MiB pool (floor {FLOOR_MIB} MiB)")

        # Nothing half-made: the node holds exactly the snapshots recorded, no stray directory.
        listed = {s["id"] for s in (await _ok(await g.get(f"/v1/sessions/{sid}/snapshots")))["items"]}
        assert listed == set(taken) == set(runtime.list_snapshot_ids())
        assert sorted(p.name for p in runtime.snapshots_dir.iterdir()) == sorted(taken)

        # A restore could write as much as the sandbox's RAM: refused too; the session runs on.
        _storage_full(await g.post(f"/v1/sessions/{sid}/restore", json={"snapshot_id": taken[0]}))
        session = await _ok(await g.get(f"/v1/sessions/{sid}"))
        assert session["state"] == "running"
        still = await _ok(await g.post(f"/v1/sessions/{sid}/commands", json={"cmd": "wc -c < /tmp/blob"}))
        assert still["stdout"].strip() == str(BLOB_MIB * MiB)

        # Closing the session deletes its snapshots: the space comes back and the next tenant is served.
        await _ok(await g.post(f"/v1/sessions/{sid}/close"))
        assert runtime.list_snapshot_ids() == []
    async with stack.client(await stack.tenant_key("next")) as n:
        fresh = (await _ok(await n.post("/v1/sessions", json={"memory_mib": MEMORY_MIB}), 201))["id"]
        await _ok(await n.post(f"/v1/sessions/{fresh}/snapshots"), 201)

"""Warm-up commands: run before a template's snapshot (so restores start with the command path's pages and
state), in every pooled VM and in a sandbox restored on demand before it is handed out (what a snapshot
cannot hold: QEMU's translation cache), so a user's first command is not slower than later ones. On the
fake runtime, whose snapshots keep the guest's /tmp: each warm-up leaves a line there."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.templates import store
from capsa.node.templates.source import TemplateSource
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="the fake runtime snapshots confined guests (root)")]

_LOG = "/tmp/warm-log"


@pytest.fixture
def logged_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "WARM_UP_COMMANDS", (["true"], f"echo warm >> {_LOG}"))


async def _lines(agent: NodeAgent, sid: str) -> int:
    result = await agent.guest(sid).exec(f"cat {_LOG} 2>/dev/null || true")
    return len(result.stdout.decode().splitlines())


async def _agent(tmp_path: Path, **source_args: Any) -> tuple[FakeRuntime, TemplateSource, NodeAgent]:
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = TemplateSource(runtime, image, bind=runtime.bind_identity, **source_args)
    agent = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 32, 16))
    await agent.start()
    await agent.wait_ready()
    return runtime, source, agent


@pytest.mark.usefixtures("logged_warm_up")
async def test_template_pool_and_on_demand_restores_are_warmed(tmp_path: Path) -> None:
    _, source, agent = await _agent(tmp_path, pool_size=1)
    try:
        for _ in range(200):
            if agent.pool_status()[0]["idle"] == 1:
                break
            await asyncio.sleep(0.05)
        pooled = new_id("sbx")
        assert (await agent.create(pooled, "base", 256, 1, {})).source == "pool"
        # Two rounds before the template's snapshot (kept by it), one more in the pooled VM.
        assert await _lines(agent, pooled) == 3
        await source.warm.drain()
        source.warm.default_size = 0
        on_demand = new_id("sbx")
        assert (await agent.create(on_demand, "base", 256, 1, {})).source == "restore"
        assert await _lines(agent, on_demand) == 3
    finally:
        await agent.close()


@pytest.mark.usefixtures("logged_warm_up")
async def test_warm_ups_can_be_turned_off(tmp_path: Path) -> None:
    _, _, agent = await _agent(tmp_path, pool_size=0, warm_up_rounds=0, warm_restores=False)
    try:
        sid = new_id("sbx")
        assert (await agent.create(sid, "base", 256, 1, {})).source == "restore"
        assert await _lines(agent, sid) == 0
    finally:
        await agent.close()


async def test_a_failing_warm_up_after_restore_fails_the_create_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, _, agent = await _agent(tmp_path, pool_size=0)
    try:
        monkeypatch.setattr(store, "WARM_UP_COMMANDS", ("exit 3",))
        with pytest.raises(CapsaError) as failed:
            await agent.create(new_id("sbx"), "base", 256, 1, {})
        assert failed.value.code == "sandbox_failed" and "exited with 3" in failed.value.message
        assert runtime.list() == [] and agent.list() == []
    finally:
        await agent.close()

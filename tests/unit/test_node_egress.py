"""The node agent's egress bookkeeping with real namespaces and nftables but no VM: secret values are held
only while some sandbox binds them, a failed attach leaves nothing, and a restarted agent removes the
namespaces its previous process left (only those with its own prefix)."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.egress.node_egress import NodeEgress
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

SID_A, SID_B = new_id("sec"), new_id("sec")


def _policy(*secret_ids: str) -> EgressPolicy:
    return EgressPolicy.from_data({
        "domains": [{"domain": "api.example.test"}, {"domain": "b.example.test"}],
        "secrets": [{"secret": s, "domain": "api.example.test", "env": f"K{i}"}
                    for i, s in enumerate(secret_ids)],
    })


def _netns() -> str:
    return _ip("netns", "list")


def _ip(*args: str, check: bool = True) -> str:
    # Quick, synchronous `ip` calls from async tests: nothing else runs on the loop meanwhile.
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True).stdout


@pytest_asyncio.fixture
async def egress() -> AsyncIterator[NodeEgress]:
    node = NodeEgress.create(netns_prefix=f"cne{secrets.token_hex(3)}-")
    try:
        yield node
    finally:
        await node.close()


async def test_secret_values_live_only_while_bound(egress: NodeEgress) -> None:
    a, b = new_id("sbx"), new_id("sbx")
    att_a = await egress.attach(a, _policy(SID_A), {SID_A: "value-a"}, session_id="ses_a")
    att_b = await egress.attach(b, _policy(SID_A, SID_B), {SID_A: "value-a", SID_B: "value-b"},
                                session_id="ses_b")
    assert sorted(egress.store.ids()) == sorted([SID_A, SID_B])
    assert "value-a" not in repr(egress.store)
    assert att_a.env["K0"] != att_b.env["K0"]  # placeholders are per sandbox
    # b stops binding SID_B: the node forgets it; a new binding needs its value.
    update = egress.update_policy(b, _policy(SID_A), {SID_A: "value-a"})
    assert not update.ca_reissued and egress.store.ids() == [SID_A]
    assert egress.placeholder_env(b) == {"K0": att_b.env["K0"]}  # a kept binding keeps its placeholder
    with pytest.raises(CapsaError, match="no value sent") as missing:
        egress.update_policy(b, _policy(SID_A, SID_B), {SID_A: "value-a"})
    assert missing.value.code == "secret_not_found"
    assert egress.store.ids() == [SID_A]
    net_a = egress.network(a)
    assert net_a is not None
    await egress.detach(a)
    assert egress.holds_secret(SID_A)  # b still binds it
    await egress.detach(b)
    assert egress.store.ids() == [] and egress.network(a) is None
    assert await egress.service.manager.leftovers(net_a) == []


async def test_failed_attach_leaves_nothing(egress: NodeEgress) -> None:
    sbx = new_id("sbx")
    with pytest.raises(CapsaError) as exc:
        await egress.attach(sbx, _policy(SID_A), {}, session_id=None)
    assert exc.value.code == "secret_not_found"
    assert egress.store.ids() == [] and egress.network(sbx) is None
    assert egress.service.manager.netns_name(sbx) not in _netns()


async def test_agent_start_removes_stale_namespaces_with_its_prefix(egress: NodeEgress,
                                                                    tmp_path: Path) -> None:
    manager = egress.service.manager
    stale = manager.netns_name(new_id("sbx"))
    other = f"cother{secrets.token_hex(3)}-{new_id('sbx')}"  # another agent's: must survive
    _ip("netns", "add", stale)
    _ip("netns", "add", other)
    try:
        agent = NodeAgent(FakeRuntime(tmp_path / "rt"), fake_image(tmp_path / "img"),
                          capacity=NodeCapacity(1024, 4, 4), egress=egress)
        removed = await agent.start()
        assert stale in removed and stale not in _netns() and other in _netns()
    finally:
        _ip("netns", "del", stale, check=False)
        _ip("netns", "del", other, check=False)


async def test_policy_on_a_node_without_egress_is_refused(tmp_path: Path) -> None:
    agent = NodeAgent(FakeRuntime(tmp_path / "rt"), fake_image(tmp_path / "img"),
                      capacity=NodeCapacity(1024, 4, 4))
    with pytest.raises(CapsaError) as exc:
        await agent.create(new_id("sbx"), "base", 256, 1, {}, policy=_policy())
    assert exc.value.code == "egress_unavailable" and agent.used()["sandboxes"] == 0

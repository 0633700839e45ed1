"""Networked sandboxes on the fast stack (FakeRuntime guests, real namespaces, nftables and broker): the
warm pool of base-net hands out VMs that carry a NIC and get their egress at bind time; pause, restore and
branch of a sandbox with a policy attach egress again from the session's record onto new namespaces and
taps, keep the session's placeholders, and give each branch its own network, CA and audit identity.

What needs a real guest behind the tap (an HTTPS call through the broker after resume) is in
tests/integration/test_networked_snapshots_vm.py."""

from __future__ import annotations

import asyncio
import dataclasses
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
from capsa.common.placeholders import new_placeholder
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.snapshots import LABEL_NIC
from capsa.node.egress.node_egress import EgressRequest, NodeEgress
from capsa.node.egress.trust_store import TrustStore
from capsa.node.guestlink.errors import GuestRefused, GuestUnavailable
from capsa.node.guestlink.identity import hostname_for
from capsa.node.runtime.base import Sandbox, VMSpec
from capsa.node.templates.source import NET_TEMPLATE, TemplateSource
from capsa.node.templates.store import NET_TEMPLATE_MAC
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, nftables and confined guests"),
]

SECRET = new_id("sec")
# A fake guest is a confined host process: its trust store lives in its private /tmp.
TRUST = TrustStore(bundle="/tmp/capsa-trust/ca-certificates.crt", ca_file="/tmp/capsa-trust/capsa-egress.crt")


def _policy(*, with_secret: bool = True) -> EgressPolicy:
    return EgressPolicy.from_data({
        "domains": [{"domain": "api.example.test"}],
        "secrets": ([{"secret": SECRET, "domain": "api.example.test", "env": "API_KEY"}]
                    if with_secret else []),
    })


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest_asyncio.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[NodeAgent, NodeEgress, str]]:
    prefix = f"cns{secrets.token_hex(3)}-"
    egress = NodeEgress.create(netns_prefix=prefix)
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    source = TemplateSource(runtime, image, egress=egress, pool_size=1, pool_sizes={NET_TEMPLATE: 1},
                            bind=runtime.bind_identity, trust=TRUST)
    agent = NodeAgent(runtime, image, capacity=NodeCapacity(8192, 32, 16), egress=egress, source=source)
    await agent.start()
    await agent.wait_ready()
    try:
        yield agent, egress, prefix
    finally:
        await agent.close()
        await runtime.close()
        assert not {n for n in _netns() if n.startswith(prefix)}, "namespaces left after close"


async def _pool_ready(agent: NodeAgent, template: str) -> None:
    for _ in range(600):
        if any(e["template"] == template and e["idle"] >= 1 for e in agent.pool_status()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the {template} pool did not fill: {agent.pool_status()}")


async def test_networked_sandbox_from_the_pool_pauses_resumes_and_branches(
        node: tuple[NodeAgent, NodeEgress, str]) -> None:
    agent, egress, prefix = node
    await _pool_ready(agent, NET_TEMPLATE)
    pooled = egress.pool_networks()
    assert len(pooled) == 1  # the idle base-net VM waits on a network of its own, with no broker
    placeholder = new_placeholder()
    sid = new_id("sbx")
    record = await agent.create(sid, "base", 256, 1, {"MINE": "1"}, policy=_policy(),
                                secrets={SECRET: "the-value"}, session_id="ses_parent",
                                placeholders={SECRET: placeholder})
    # Bound from the pool: its egress was attached onto the pooled VM's network at bind time.
    assert record.source == "pool" and record.networked and record.nic_mac == NET_TEMPLATE_MAC
    net = egress.network(sid)
    assert net is not None and net.sandbox_id == pooled[0].sandbox_id
    assert egress.service._attached[sid][1].sandbox_id == sid  # its drop events are the session's
    assert record.env["API_KEY"] == placeholder and record.env["MINE"] == "1"
    assert record.env["HTTPS_PROXY"] == net.proxy_url
    broker = egress.service.broker
    ca_first = broker.get(sid).ca.cert_pem
    # The CA went in by file writes onto the copy of the image's bundle made when base-net was built.
    bundle = await record.sandbox.guest.read_file(TRUST.bundle)
    assert bundle.endswith(ca_first) and await record.sandbox.guest.read_file(TRUST.base) == b""
    await agent.guest(sid).write_file("/tmp/work.txt", _chunks(b"state before pause"))

    snap = await agent.pause(sid)
    assert agent.snapshots is not None
    assert agent.snapshots.open(snap["id"]).manifest.labels[LABEL_NIC] == NET_TEMPLATE_MAC
    # Paused: its network, listeners, CA, placeholders and secret are gone from the node.
    assert egress.network(sid) is None and net.netns not in _netns() and not egress.holds_secret(SECRET)
    with pytest.raises(CapsaError) as refused:
        await agent.restore(snap["id"], new_id("sbx"), {})
    assert refused.value.code == "policy_required"

    # Resume: egress again from the session's record, on a new namespace and tap.
    resumed_id = new_id("sbx")
    request = EgressRequest(_policy(), {SECRET: "the-value"}, {SECRET: placeholder}, "ses_parent")
    resumed = await agent.restore(snap["id"], resumed_id, {"MINE": "1"}, egress=request)
    new_net = egress.network(resumed_id)
    assert new_net is not None and new_net.netns != net.netns and new_net.netns in _netns()
    assert resumed.networked and resumed.nic_mac == NET_TEMPLATE_MAC
    assert resumed.env["API_KEY"] == placeholder  # what the guest holds keeps working
    state = broker.get(resumed_id)
    assert state.session_id == "ses_parent" and state.placeholders[placeholder].secret == SECRET
    assert state.ca.cert_pem != ca_first  # a new CA, and only it, in the guest's trust store
    bundle = await resumed.sandbox.guest.read_file(TRUST.bundle)
    assert bundle.endswith(state.ca.cert_pem) and ca_first not in bundle
    assert await resumed.sandbox.guest.read_file("/tmp/work.txt") == b"state before pause"

    # Branch into 3: each its own namespace, tap, CA and audit identity, all holding the parent's
    # placeholder, each under its own copy of the policy.
    parent_snap = await agent.snapshot(resumed_id)
    ids = [new_id("sbx") for _ in range(3)]
    requests = [EgressRequest(_policy(), {SECRET: "the-value"}, {SECRET: placeholder}, f"ses_child{i}")
                for i in range(3)]
    children = await agent.branch(parent_snap["id"], ids, {}, egress=requests)
    nets = [egress.network(i) for i in ids]
    assert all(n is not None for n in nets)
    assert len({n.netns for n in nets if n} | {new_net.netns}) == 4
    assert len({n.tap for n in nets if n}) == 3
    cas = {broker.get(i).ca.cert_pem for i in ids}
    assert len(cas | {state.ca.cert_pem}) == 4
    for i, child in enumerate(children):
        child_state = broker.get(child.id)
        assert child_state.session_id == f"ses_child{i}"
        assert child_state.placeholders[placeholder].secret == SECRET
        assert child.env["API_KEY"] == placeholder
        assert (await child.sandbox.guest.read_file(TRUST.bundle)).endswith(child_state.ca.cert_pem)
    # One branch's policy change is its own: the placeholder stops working there only.
    await agent.update_policy(ids[0], _policy(with_secret=False), {})
    assert broker.get(ids[0]).placeholders == {}
    assert broker.get(ids[1]).placeholders[placeholder].secret == SECRET

    for sandbox_id in [resumed_id, *ids]:
        await agent.destroy(sandbox_id)
    assert not egress.holds_secret(SECRET)
    left = {n for n in _netns() if n.startswith(prefix)}
    # Only the refilled pool's network remains.
    assert left == {pooled_net.netns for pooled_net in egress.pool_networks()}
    for gone in [net, new_net, *nets]:
        assert gone is not None and await egress.service.manager.leftovers(gone) == []


async def test_restoring_a_snapshot_keeps_to_its_network_device(
        node: tuple[NodeAgent, NodeEgress, str]) -> None:
    agent, _egress, _prefix = node
    offline = new_id("sbx")
    await agent.create(offline, "base", 256, 1, {})
    snap = await agent.snapshot(offline)
    with pytest.raises(CapsaError) as refused:
        await agent.restore(snap["id"], new_id("sbx"), {}, egress=EgressRequest(_policy(with_secret=False)))
    assert refused.value.code == "no_network"
    restored = await agent.restore(snap["id"], new_id("sbx"), {})
    assert not restored.networked and restored.nic_mac is None


async def test_a_placeholder_must_look_like_one(node: tuple[NodeAgent, NodeEgress, str]) -> None:
    agent, egress, _prefix = node
    sid = new_id("sbx")
    with pytest.raises(CapsaError) as refused:
        await agent.create(sid, "base", 256, 1, {}, policy=_policy(), secrets={SECRET: "v"},
                           placeholders={SECRET: "the-real-secret"})
    assert refused.value.code == "bad_request" and egress.network(sid) is None
    assert agent.used()["sandboxes"] == 0


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_hundred_networked_create_pause_resume_close_cycles_leave_nothing(
        node: tuple[NodeAgent, NodeEgress, str]) -> None:
    agent, egress, prefix = node
    request = EgressRequest(_policy(), {SECRET: "v"}, {SECRET: new_placeholder()}, "ses_cycle")
    sources: list[str] = []
    cycles = 0
    for _ in range(100):
        sid = new_id("sbx")
        record = await agent.create(sid, "base", 256, 1, {}, policy=request.policy, secrets=request.secrets,
                                    session_id="ses_cycle", placeholders=request.placeholders)
        sources.append(record.source)
        snap = await agent.pause(sid)
        resumed = new_id("sbx")
        await agent.restore(snap["id"], resumed, {}, egress=request)
        await agent.destroy(resumed)
        await agent.delete_snapshot(snap["id"])
        cycles += 1
        # Nothing of the session is left; only the warm pool's own idle network may exist. A refill may be
        # making (or the pool dropping) one right now: its namespace exists a moment before (after) the
        # pool lists it, so wait (bounded) for the pool to settle.
        for _ in range(150):
            pool_netns = {n.netns for n in egress.pool_networks()}
            strays = {n for n in _netns() if n.startswith(prefix)} - pool_netns
            if not strays and len(pool_netns) <= 1:
                break
            await asyncio.sleep(0.2)
        assert not strays and len(pool_netns) <= 1, (strays, pool_netns)
        assert not egress.holds_secret(SECRET) and egress.service._attached == {}
    assert cycles == 100 and "pool" in sources
    assert agent.list() == [] and agent.used()["sandboxes"] == 0 and agent.list_snapshots() == []


async def test_a_template_with_a_nic_is_pooled_on_a_network_of_its_own(
        node: tuple[NodeAgent, NodeEgress, str]) -> None:
    """Templates with ``network: true`` (browser, desktop) have a warm pool like base: the idle VM waits on
    a network of its own with no broker, and a session binds it by attaching its egress."""
    agent, egress, _prefix = node
    source = agent.source
    assert isinstance(source, TemplateSource)
    async with egress.throwaway_network() as net:
        spec = VMSpec(image=source.image, memory_mib=256, vcpus=1,
                      network=dataclasses.replace(net, mac=NET_TEMPLATE_MAC), labels={"template": "webby"})
        await source.store.store("webby", await source.runtime.boot(spec), spec={"network": True})
    first_id = new_id("sbx")
    first = await agent.create(first_id, "webby", 256, 1, {}, policy=_policy(with_secret=False),
                               session_id="ses_one")
    assert first.source == "restore" and first.networked  # the first one is restored; the pool then fills
    await _pool_ready(agent, "webby")
    idle = {n.sandbox_id for n in egress.pool_networks()}  # base-net's and webby's idle VMs
    sid = new_id("sbx")
    second = await agent.create(sid, "webby", 256, 1, {}, policy=_policy(with_secret=False),
                                session_id="ses_two")
    assert second.source == "pool" and second.networked and second.nic_mac == NET_TEMPLATE_MAC
    bound = egress.network(sid)
    assert bound is not None and bound.sandbox_id in idle
    assert bound.sandbox_id not in {n.sandbox_id for n in egress.pool_networks()}
    assert (await second.sandbox.guest.exec(["true"])).exit_code == 0
    for done in (first_id, sid):
        assert await agent.destroy(done)


@pytest.mark.parametrize(("failure", "cold_boots"), [
    (GuestUnavailable("the guest daemon restarted"), False),  # 503: would fail a cold boot's bind as well
    (GuestRefused("bad_request", "refused"), False),  # 400: the request's own fault
    (GuestRefused("io_error", "disk trouble"), True),  # 500: the restored VM's fault; a fresh boot may work
])
async def test_a_failed_restore_bind_cold_boots_only_when_the_fault_is_the_restored_vms(
        tmp_path: Path, failure: CapsaError, cold_boots: bool) -> None:
    prefix = f"cns{secrets.token_hex(3)}-"
    egress = NodeEgress.create(netns_prefix=prefix)
    runtime = FakeRuntime()
    image = fake_image(tmp_path / "img")
    sid = new_id("sbx")

    binds: list[str] = []

    async def bind(sandbox: Sandbox, hostname: str) -> None:
        binds.append(hostname)
        if binds.count(hostname_for(sid)) == 1 and hostname == hostname_for(sid):  # the restored VM's bind
            raise failure
        await runtime.bind_identity(sandbox, hostname)

    source = TemplateSource(runtime, image, egress=egress, pool_size=0, bind=bind, trust=TRUST)
    agent = NodeAgent(runtime, image, capacity=NodeCapacity(8192, 32, 16), egress=egress, source=source)
    await agent.start()
    await agent.wait_ready()
    await source.net_template(256, 1)  # base-net is built (by a boot of its own) before the request
    boots = runtime.boots
    try:
        if cold_boots:
            record = await agent.create(sid, "base", 256, 1, {}, policy=_policy(with_secret=False))
            assert record.source == "boot" and runtime.boots == boots + 1
        else:
            with pytest.raises(CapsaError) as raised:
                await agent.create(sid, "base", 256, 1, {}, policy=_policy(with_secret=False))
            assert raised.value is failure and runtime.boots == boots
            assert egress.network(sid) is None  # nothing of the refused sandbox is left
    finally:
        await agent.close()
        await runtime.close()
        assert not {n for n in _netns() if n.startswith(prefix)}, "namespaces left after close"

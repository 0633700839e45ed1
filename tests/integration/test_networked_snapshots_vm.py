"""Networked sessions are first-class with real VMs (TCG here): the warm pool, pause/resume and branch.

A :class:`NodeAgent` with the template source, a base-net warm pool and egress against
tests.support.outside's outside world (every address in namespaces this test creates):

- a session with a policy and a bound secret comes from the warm pool (the pooled VM's network gets its
  broker, rules, DNS and CA at bind time); the allowed HTTPS call succeeds with the secret injected, a direct
  IP is refused, the placeholder sent elsewhere is refused;
- pause -> resume (restore with the session's record: policy, secret, placeholder) onto a new namespace and
  tap: the guest's address, route and DNS come back by themselves, the same calls give the same answers, and
  the audit trail continues under the same session;
- branch into 3: each branch has its own namespace, tap, CA and audit identity, the parent's placeholder
  (in the branch's env, copied from its memory) works in each for the bound host only;
- nothing is left on the host afterwards (namespaces, taps, VMs, pool files);
- through the API, a session with rolling snapshots whose VM is killed resumes with its files and network.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.common.image import GuestImage
from capsa.common.placeholders import new_placeholder
from capsa.common.settings import Settings
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.sandboxes import SandboxRecord
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import EgressRequest, NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool
from capsa.node.templates.source import NET_TEMPLATE, TemplateSource
from capsa.node.templates.store import NET_TEMPLATE_MAC
from tests.support.api_stack import ApiStack
from tests.support.leftovers import netns_with, wait_no_vm_leftovers
from tests.support.outside import (
    OTHER_ID,
    OTHER_SECRET,
    SECRET,
    SECRET_ID,
    World,
    outside_world,
    world_policy,
)
from tests.support.resolvers import DnsResolver

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables, loop btrfs pool)"),
]

# Runs in the guest with the session env. Python stdlib only.
PROBE = r'''
import json, os, socket, ssl, sys, urllib.error, urllib.request
world = sys.argv[1]
out = {}
dev = next(d for d in os.listdir("/sys/class/net") if d != "lo")
out["mac"] = open(f"/sys/class/net/{dev}/address").read().strip()
out["addr"] = os.popen(f"ip -4 -o addr show dev {dev}").read()
out["resolv"] = open("/etc/resolv.conf").read()
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                     urllib.request.HTTPSHandler(context=ssl.create_default_context()))
def call(url):
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
    try:
        with opener.open(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
out["allowed"], out["allowed_body"] = call("https://api.allowed.test/leak-header")
out["elsewhere"], _ = call("https://x.allowed.test/v1/echo")
try:
    plain = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with plain.open(f"http://{world}/", timeout=20) as r:
        out["direct_ip_http"] = r.status
except urllib.error.HTTPError as e:
    out["direct_ip_http"] = e.code
except Exception as e:
    out["direct_ip_http"] = "error " + type(e).__name__
print(json.dumps(out))
'''


async def _probe(record: SandboxRecord, world_ip: str) -> dict[str, object]:
    result = await record.sandbox.guest.exec(["python3", "-c", PROBE, world_ip], env=dict(record.env),
                                             timeout=300)
    assert result.exit_code == 0, result.stderr.decode(errors="replace")
    out: dict[str, object] = json.loads(result.stdout)
    return out


def _check(seen: dict[str, object], egress: NodeEgress, sandbox_id: str) -> None:
    net = egress.network(sandbox_id)
    assert net is not None
    assert seen["mac"] == NET_TEMPLATE_MAC
    assert f"{net.guest_ip}/{net.prefixlen}" in str(seen["addr"]) and str(seen["addr"]).count("inet ") == 1
    assert f"nameserver {net.dns_server}" in str(seen["resolv"])
    assert seen["allowed"] == 200, seen
    echoed = json.loads(str(seen["allowed_body"]))["headers"]
    assert echoed["authorization"] == "Bearer [REDACTED]"  # injected upstream, redacted on the way back
    assert seen["elsewhere"] == 403  # the placeholder towards another host is refused
    assert seen["direct_ip_http"] == 403


async def _pool_ready(agent: NodeAgent, template: str, within: float = 900) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if any(e["template"] == template and e["idle"] >= 1 for e in agent.pool_status()):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"the {template} pool did not fill: {agent.pool_status()}")


def _egress(world: World, octet: int, prefix: str) -> NodeEgress:
    audit = AuditLog()
    store = InMemorySecretStore(SecretBox(os.urandom(32)))
    broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                          upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                          allow_networks=[world.net])
    manager = NetworkManager(netns_prefix=prefix)
    return NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)


async def test_networked_session_from_the_pool_pauses_resumes_and_branches(
        state_dir: Path, pool: StoragePool, guest_image: GuestImage) -> None:
    octet = 200 + secrets.randbelow(50)
    prefix = f"cns{secrets.token_hex(3)}-"
    async with outside_world(octet) as world:
        egress = _egress(world, octet, prefix)
        audit, broker, manager = egress.audit, egress.service.broker, egress.service.manager
        settings = Settings(state_dir=state_dir, cache_dir=Settings().cache_dir)
        runtime = QemuRuntime(settings, storage=PoolStorage(pool))
        source = TemplateSource(runtime, guest_image, egress=egress,
                                pool_sizes={"base": 0, NET_TEMPLATE: 1})
        agent = NodeAgent(runtime, guest_image, egress=egress, source=source)
        await agent.start()
        try:
            await agent.wait_ready()
            await _pool_ready(agent, NET_TEMPLATE)
            values = {SECRET_ID: SECRET, OTHER_ID: OTHER_SECRET}
            placeholders = {SECRET_ID: new_placeholder()}
            request = EgressRequest(world_policy(), values, placeholders, "ses_parent")

            # From the warm pool: egress attached to the pooled VM's network at bind time.
            sid = "sbx_" + secrets.token_hex(10)
            started = time.perf_counter()
            record = await agent.create(sid, "base", 256, 1, {}, policy=request.policy, secrets=values,
                                        session_id="ses_parent", placeholders=placeholders)
            first = await agent.guest(sid).exec(["true"])
            create_and_first = time.perf_counter() - started
            assert first.exit_code == 0
            assert record.source == "pool" and record.env["API_KEY"] == placeholders[SECRET_ID]
            print(f"\nnetworked create from the pool: {record.create_ms:.0f} ms; "
                  f"create + first command: {create_and_first * 1000:.0f} ms")
            _check(await _probe(record, world.ip), egress, sid)

            # Pause -> resume onto a new namespace and tap, from the session's record.
            snap = await agent.pause(sid)
            assert egress.network(sid) is None and not netns_with(prefix + sid)
            resumed_id = "sbx_" + secrets.token_hex(10)
            t0 = time.perf_counter()
            resumed = await agent.restore(snap["id"], resumed_id, {}, egress=request)
            print(f"networked resume: {(time.perf_counter() - t0) * 1000:.0f} ms")
            assert resumed.env["API_KEY"] == placeholders[SECRET_ID]
            _check(await _probe(resumed, world.ip), egress, resumed_id)
            events = [ev for _, ev in audit.read(0, audit.epoch, 100_000).events]
            injected = [e for e in events if e.kind == "http" and e.secret_ids == [SECRET_ID]]
            # The trail continues under the same session, across both sandboxes.
            assert {e.sandbox_id for e in injected} == {sid, resumed_id}
            assert {e.session_id for e in injected} == {"ses_parent"}

            # Branch into 3, each with its own network, CA and audit identity.
            parent = await agent.pause(resumed_id)
            ids = ["sbx_" + secrets.token_hex(10) for _ in range(3)]
            requests = [EgressRequest(world_policy(), values, placeholders, f"ses_child{i}")
                        for i in range(3)]
            children = await agent.branch(parent["id"], ids, {}, egress=requests)
            nets = [egress.network(i) for i in ids]
            assert len({n.netns for n in nets if n is not None}) == 3
            assert len({broker.get(i).ca.cert_pem for i in ids}) == 3
            for child in children:
                assert child.env["API_KEY"] == placeholders[SECRET_ID]
                _check(await _probe(child, world.ip), egress, child.id)
            events = [ev for _, ev in audit.read(0, audit.epoch, 100_000).events]
            for i, child_id in enumerate(ids):
                mine = [e for e in events if e.kind == "http" and e.sandbox_id == child_id
                        and e.secret_ids == [SECRET_ID]]
                assert mine and {e.session_id for e in mine} == {f"ses_child{i}"}
            for child_id in ids:
                await agent.destroy(child_id)
            for n in nets:
                assert n is not None and await manager.leftovers(n) == []
        finally:
            await agent.close()
        assert netns_with(prefix) == []
        assert wait_no_vm_leftovers(state_dir) == []


ALLOWED = r'''
import json, os, ssl, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                     urllib.request.HTTPSHandler(context=ssl.create_default_context()))
req = urllib.request.Request("https://api.allowed.test/leak-header",
                             headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
with opener.open(req, timeout=60) as r:
    print(json.dumps({"status": r.status, "body": r.read().decode(), "key": os.environ["API_KEY"]}))
'''


async def _run(api: httpx.AsyncClient, sid: str, cmd: list[str]) -> dict[str, Any]:
    response = await api.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd, "timeout": 300}, timeout=400)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    assert result["exit_code"] == 0, result
    return result


async def _until(check: Callable[[], Awaitable[bool]], what: str, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


async def test_rolling_snapshot_networked_session_survives_its_vm_through_the_api(
        state_dir: Path, pool: StoragePool, guest_image: GuestImage) -> None:
    """Through the API: a session with a policy, a bound secret and rolling snapshots loses its VM (SIGKILL);
    the control plane pauses it at its latest snapshot; resume brings back its files and its network, the
    same placeholder still gets the secret injected, and the audit trail continues under the session."""
    octet = 200 + secrets.randbelow(50)
    prefix = f"cnq{secrets.token_hex(3)}-"
    async with outside_world(octet) as world:
        egress = _egress(world, octet, prefix)
        runtime = QemuRuntime(Settings(state_dir=state_dir, cache_dir=Settings().cache_dir),
                              storage=PoolStorage(pool))
        key = base64.b64encode(os.urandom(32)).decode()
        stack = ApiStack(f"sqlite+aiosqlite:///{state_dir}/capsa.db", runtime, guest_image,  # type: ignore[arg-type]
                         # No heartbeat loop runs here: a node silent for the default 30 s (template
                         # builds under TCG) would count as lost and its session be paused.
                         settings={"secret_key": key, "reaper_interval": 0.3,
                                   "rolling_snapshot_interval": 0.3, "node_heartbeat_timeout": 3600},
                         egress=egress)
        async with stack:
            assert stack.agent is not None
            async with stack.client(await stack.tenant_key("acme")) as api:
                made = await api.post("/v1/secrets", json={"name": "upstream", "value": SECRET})
                assert made.status_code == 201, made.text
                policy = {"domains": [{"domain": "api.allowed.test"}],
                          "secrets": [{"secret": "upstream", "domain": "api.allowed.test", "env": "API_KEY"}]}
                created = await api.post("/v1/sessions", json={
                    "policy": policy, "rolling_snapshots": {"after_command": True, "keep": 2}})
                assert created.status_code == 201, created.text
                sid = created.json()["id"]
                first = json.loads((await _run(api, sid, ["python3", "-c", ALLOWED]))["stdout"])
                assert first["status"] == 200 and SECRET not in first["key"]

                async def rolled(n: int) -> bool:
                    items = (await api.get(f"/v1/sessions/{sid}/snapshots")).json()["items"]
                    return len([s for s in items if s["kind"] == "rolling"]) >= n

                # One snapshot after the first command before the second runs: two commands that both end
                # before the rolling pass claims the session are rightly covered by one snapshot.
                await _until(lambda: rolled(1), "a rolling snapshot after the first command")
                await _run(api, sid, ["sh", "-c", "echo networked > /root/state"])
                await _until(lambda: rolled(2), "a rolling snapshot after the second command")
                (record,) = stack.agent.list()
                pid = record.sandbox.process.pid  # type: ignore[attr-defined]
                os.kill(pid, signal.SIGKILL)

                async def noticed() -> bool:
                    return record.id in stack.agent.failed_sandboxes()

                await _until(noticed, "the node to notice the dead VM", 30)
                await stack.heartbeat()
                info = (await api.get(f"/v1/sessions/{sid}")).json()
                assert info["state"] == "paused", info
                resumed = await api.post(f"/v1/sessions/{sid}/resume")
                assert resumed.status_code == 200, resumed.text
                assert (await _run(api, sid, ["cat", "/root/state"]))["stdout"] == "networked\n"
                again = json.loads((await _run(api, sid, ["python3", "-c", ALLOWED]))["stdout"])
                assert again["status"] == 200 and again["key"] == first["key"]
                assert json.loads(again["body"])["headers"]["authorization"] == "Bearer [REDACTED]"
                (now,) = stack.agent.list()
                assert now.id != record.id and egress.network(now.id) is not None
                page = await api.get(f"/v1/sessions/{sid}/audit", params={"limit": 500})
                injected = [e for e in page.json()["items"] if e["kind"] == "http" and e["secret_ids"]]
                assert {e["sandbox_id"] for e in injected} == {record.id, now.id}
                assert (await api.post(f"/v1/sessions/{sid}/close")).status_code == 200
        assert netns_with(prefix) == [] and egress.store.ids() == []
    assert wait_no_vm_leftovers(state_dir) == []

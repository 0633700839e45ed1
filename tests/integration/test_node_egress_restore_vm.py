"""Sessions with an egress policy restored from the networked template, with real VMs (TCG here).

A :class:`NodeAgent` with the template source and egress builds ``base-net`` (``base`` plus a NIC with a
fixed MAC, booted once on a throwaway tap) and restores a sandbox with a policy from it onto that
sandbox's own tap: the create source is ``restore``, the guest has this sandbox's address, the allowed
HTTPS call goes through the broker with the secret injected, a direct IP is refused, its snapshot carries
the NIC (restoring it needs the policy), and destroying it removes namespace, tap and rules. When the
restore fails, the sandbox cold-boots (source ``boot``) on the same tap instead and nothing of the failed
attempt is left.

Every address involved lives in namespaces this test creates (tests.support.outside's outside
world). At most one sandbox VM runs at a time, to spare the 2 cores.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
import subprocess
from pathlib import Path

import pytest

from capsa.common.errors import CapsaError
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.sandboxes import SandboxRecord
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.source import NET_TEMPLATE, TemplateSource
from capsa.node.templates.store import NET_TEMPLATE_MAC
from tests.support.outside import OTHER_ID, OTHER_SECRET, SECRET, SECRET_ID, outside_world, world_policy
from tests.support.resolvers import DnsResolver

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(900),
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
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                     urllib.request.HTTPSHandler(context=ssl.create_default_context()))
req = urllib.request.Request("https://api.allowed.test/leak-header",
                             headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
with opener.open(req, timeout=60) as r:
    out["allowed"] = r.status
    out["allowed_body"] = r.read().decode()
try:
    c = ssl.create_default_context()
    c.check_hostname = False
    c.verify_mode = ssl.CERT_NONE
    s = c.wrap_socket(socket.create_connection((world, 443), timeout=10))
    out["direct_ip_https"] = "connected"
except Exception as e:
    out["direct_ip_https"] = "error " + type(e).__name__
try:
    plain = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with plain.open(f"http://{world}/", timeout=20) as r:
        out["direct_ip_http"] = r.status
except urllib.error.HTTPError as e:
    out["direct_ip_http"] = e.code
except Exception as e:
    out["direct_ip_http"] = "error " + type(e).__name__
try:
    socket.create_connection((world, 8000), timeout=3)
    out["other_port"] = "connected"
except Exception as e:
    out["other_port"] = "error " + type(e).__name__
print(json.dumps(out))
'''


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


async def _probe(record: SandboxRecord, world_ip: str) -> dict[str, object]:
    result = await record.sandbox.guest.exec(["python3", "-c", PROBE, world_ip], env=dict(record.env),
                                             timeout=300)
    assert result.exit_code == 0, result.stderr.decode(errors="replace")
    out: dict[str, object] = json.loads(result.stdout)
    return out


async def test_policy_sessions_are_restored_from_the_networked_template(
        state_dir: Path, guest_image: GuestImage, monkeypatch: pytest.MonkeyPatch) -> None:
    octet = 200 + secrets.randbelow(50)
    pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=4096, require_cow=True))
    try:
        async with outside_world(octet) as world:
            audit = AuditLog()
            store = InMemorySecretStore(SecretBox(os.urandom(32)))
            broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                                  upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                                  allow_networks=[world.net])
            prefix = f"cnr{secrets.token_hex(3)}-"
            manager = NetworkManager(netns_prefix=prefix)
            egress = NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)
            settings = Settings(state_dir=state_dir, cache_dir=Settings().cache_dir)
            runtime = QemuRuntime(settings, storage=PoolStorage(pool))
            source = TemplateSource(runtime, guest_image, pool_size=0, egress=egress)
            agent = NodeAgent(runtime, guest_image, egress=egress, source=source)
            await agent.start()
            try:
                await agent.wait_ready()
                policy = world_policy()
                values = {SECRET_ID: SECRET, OTHER_ID: OTHER_SECRET}

                # The first one builds base-net (a cold boot on a throwaway tap), then restores from it.
                sid = "sbx_" + secrets.token_hex(10)
                record = await agent.create(sid, "base", 256, 1, {"MINE": "1"}, policy=policy,
                                            secrets=values, session_id="ses_a")
                assert record.source == "restore"
                assert record.networked and isinstance(record.sandbox, QemuSandbox)
                net_tpl = source.store.find(NET_TEMPLATE, 256, 1)
                assert net_tpl is not None and record.snapshot == net_tpl.snapshot.id
                assert prefix not in "".join(line for line in _netns().splitlines() if sid not in line)
                net = egress.network(sid)
                assert net is not None and record.env["MINE"] == "1"
                placeholder = record.env["API_KEY"]
                assert placeholder != SECRET and placeholder == record.egress_env["API_KEY"]

                seen = await _probe(record, world.ip)
                assert seen["mac"] == NET_TEMPLATE_MAC
                assert f"{net.guest_ip}/{net.prefixlen}" in str(seen["addr"])
                assert str(seen["addr"]).count("inet ") == 1  # the template's build address is gone
                assert seen["allowed"] == 200
                echoed = json.loads(str(seen["allowed_body"]))["headers"]
                assert echoed["authorization"] == "Bearer [REDACTED]"  # injected upstream, redacted back
                assert str(seen["direct_ip_https"]).startswith("error")
                assert seen["direct_ip_http"] == 403
                assert str(seen["other_port"]).startswith("error")
                events = [ev for _, ev in audit.read(0, audit.epoch, 100_000).events]
                injected = [e for e in events if e.kind == "http" and e.secret_ids == [SECRET_ID]]
                assert injected and injected[0].decision == "allow" and injected[0].sandbox_id == sid
                assert any(e.kind == "http" and e.decision == "deny" and e.sandbox_id == sid for e in events)

                # base-net is internal: not offered, and no session can ask for it.
                assert NET_TEMPLATE not in agent.info()["templates"]  # type: ignore[operator]
                with pytest.raises(CapsaError) as internal:
                    await agent.create("sbx_" + secrets.token_hex(10), NET_TEMPLATE, 256, 1, {})
                assert internal.value.code == "template_not_found"

                # A networked sandbox's snapshot carries its NIC: restoring it takes the session's policy.
                snap = await agent.snapshot(sid)
                with pytest.raises(CapsaError) as refused:
                    await agent.restore(snap["id"], "sbx_" + secrets.token_hex(10), {})
                assert refused.value.code == "policy_required"
                await agent.delete_snapshot(snap["id"])

                await agent.destroy(sid)
                assert egress.network(sid) is None
                assert net.netns not in _netns() and prefix not in _netns()
                assert net.tap not in _links()

                # A restore that fails falls back to a cold boot, leaving nothing of the failed attempt.
                async def broken(*_a: object, **_k: object) -> QemuSandbox:
                    assert egress.network(sid2) is not None  # egress was attached before the restore
                    raise RuntimeError("restore broken on purpose")

                sid2 = "sbx_" + secrets.token_hex(10)
                with monkeypatch.context() as m:
                    m.setattr(runtime, "restore", broken)
                    cold = await agent.create(sid2, "base", 256, 1, {}, policy=policy, secrets=values,
                                              session_id="ses_b")
                assert cold.source == "boot" and cold.snapshot is None and cold.networked
                assert [r.id for r in agent.list()] == [sid2]
                seen = await _probe(cold, world.ip)
                assert seen["allowed"] == 200 and seen["direct_ip_http"] == 403
                net2 = egress.network(sid2)
                assert net2 is not None
                await agent.destroy(sid2)
                assert egress.network(sid2) is None and prefix not in _netns()
                assert net2.tap not in _links()
            finally:
                await agent.close()
            assert prefix not in _netns()
            assert runtime.list() == []
    finally:
        pool.destroy()

"""What egress costs a session on the node: attaching a sandbox's network + broker + CA (and detaching it),
against the bare namespace/tap/nftables part alone; live policy updates with and without a CA re-issue;
sealing and opening a stored secret in the control plane. With ``--vm``, also the time to install the
sandbox CA in a real guest's trust store (the step that runs on every session creation with a policy),
and creating a sandbox with a policy on a NodeAgent with a TemplateSource: bound from base-net's warm pool
(and its first command), restored from the networked template on demand, and the cold-boot path it falls
back to (all include egress attach and the CA install).

Needs root (namespaces, nftables). Writes bench/results/egress_session.json and prints a table.

    .venv/bin/python bench/egress_session.py [--n 20] [--vm]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from capsa.common.egress_policy import EgressPolicy
from capsa.common.ids import new_id
from capsa.control.secretbox import SecretSealer
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.net.sandbox_net import NetworkManager
from harness import host_facts, summary, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "egress_session.json"
SECRET_ID = new_id("sec")


def _policy(extra: int = 0) -> EgressPolicy:
    domains = [{"domain": "api.example.test"}, {"domain": "*.example.test"}]
    domains += [{"domain": f"more{i}.bench.test"} for i in range(extra)]
    return EgressPolicy.from_data({"domains": domains, "secrets": [
        {"secret": SECRET_ID, "domain": "api.example.test", "env": "API_KEY"}]})


async def _attach_detach(n: int, prefix: str) -> dict[str, Any]:
    egress = NodeEgress.create(netns_prefix=prefix)
    attach, detach, update_same, update_reissue = [], [], [], []
    try:
        for i in range(n):
            sid = new_id("sbx")
            t0 = time.perf_counter()
            await egress.attach(sid, _policy(), {SECRET_ID: "v"}, session_id="ses_bench")
            t1 = time.perf_counter()
            egress.update_policy(sid, _policy(), {SECRET_ID: "v"})
            t2 = time.perf_counter()
            update = egress.update_policy(sid, _policy(extra=i % 3 + 1), {SECRET_ID: "v"})
            t3 = time.perf_counter()
            assert update.ca_reissued
            await egress.detach(sid)
            t4 = time.perf_counter()
            attach.append((t1 - t0) * 1000)
            update_same.append((t2 - t1) * 1000)
            update_reissue.append((t3 - t2) * 1000)
            detach.append((t4 - t3) * 1000)
    finally:
        await egress.close()
    return {"attach_ms": summary(attach), "detach_ms": summary(detach),
            "update_policy_same_domains_ms": summary(update_same),
            "update_policy_ca_reissue_ms": summary(update_reissue)}


async def _bare_network(n: int, prefix: str) -> dict[str, Any]:
    manager = NetworkManager(netns_prefix=prefix)
    create, destroy = [], []
    for _ in range(n):
        sid = new_id("sbx")
        t0 = time.perf_counter()
        net = await manager.create(sid)
        t1 = time.perf_counter()
        await manager.destroy(net)
        create.append((t1 - t0) * 1000)
        destroy.append((time.perf_counter() - t1) * 1000)
    return {"netns_tap_rules_create_ms": summary(create), "netns_destroy_ms": summary(destroy)}


def _sealing(n: int) -> dict[str, Any]:
    sealer = SecretSealer.from_text(base64.b64encode(os.urandom(32)).decode())
    value = "sk-" + secrets.token_hex(32)
    seal, open_ = [], []
    for i in range(n):
        t0 = time.perf_counter()
        blob = sealer.seal("tenant", f"sec_{i}", value)
        t1 = time.perf_counter()
        assert sealer.open("tenant", f"sec_{i}", blob) == value
        seal.append((t1 - t0) * 1e6)
        open_.append((time.perf_counter() - t1) * 1e6)
    return {"seal_us": summary(seal), "open_us": summary(open_)}


async def _ca_install(n: int) -> dict[str, Any]:
    from capsa.common.settings import Settings
    from capsa.images import ensure_image
    from capsa.node.egress.ca import SandboxCA
    from capsa.node.egress.trust_store import TrustStore
    from capsa.node.runtime.base import VMSpec
    from capsa.node.runtime.qemu import QemuRuntime

    state = Path(tempfile.mkdtemp(prefix="ceb-", dir="/tmp"))
    os.chmod(state, 0o711)  # QEMU runs unprivileged
    runtime = QemuRuntime(Settings(state_dir=state), accel="auto", accel_cache=False)
    sandbox = None
    script, writes = [], []
    trust = TrustStore()
    try:
        sandbox = await runtime.boot(VMSpec(image=await asyncio.to_thread(ensure_image, Settings())),
                                     sandbox_id=new_id("sbx"))
        for i in range(n + 1):
            pem = SandboxCA(f"bench{i}", ["example.test"]).cert_pem
            t0 = time.perf_counter()
            fast = await trust.install(sandbox.guest, pem)
            # The first install (a cold-booted guest) keeps the image's bundle by a script; the rest (and
            # every base-net guest, whose template kept it) are file writes.
            (writes if fast else script).append((time.perf_counter() - t0) * 1000)
    finally:
        if sandbox is not None:
            await runtime.destroy(sandbox)
        await runtime.close()
        shutil.rmtree(state, ignore_errors=True)
    return {"guest_ca_install_ms": summary(writes), "guest_ca_install_script_ms": summary(script),
            "accelerator": str(sandbox.accelerator) if sandbox else None}


async def _pool_filled(source: Any, template: str) -> None:
    for _ in range(3000):
        if any(e["template"] == template and e["idle"] for e in source.pool_status()):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the {template} pool did not fill")


async def _create_with_policy(n: int) -> dict[str, Any]:
    from capsa.common.settings import Settings
    from capsa.images import ensure_image
    from capsa.node.agent.agent import NodeAgent
    from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
    from capsa.node.storage import StoragePool, StorageSettings
    from capsa.node.templates.source import NET_TEMPLATE, TemplateSource

    state = Path(tempfile.mkdtemp(prefix="cec-", dir="/var/tmp"))
    os.chmod(state, 0o711)
    pool = StoragePool.open(state, StorageSettings(loop_size_mib=4096))
    egress = NodeEgress.create(netns_prefix=f"cec{secrets.token_hex(2)}-")
    runtime = QemuRuntime(Settings(state_dir=state), storage=PoolStorage(pool))
    image = await asyncio.to_thread(ensure_image, Settings())
    source = TemplateSource(runtime, image, pool_size=0, egress=egress)
    agent = NodeAgent(runtime, image, egress=egress, source=source)
    # The cold-boot path the template source falls back to, on the same runtime and egress (not closed:
    # ``agent.close()`` closes those).
    cold_agent = NodeAgent(runtime, image, egress=egress)
    # The warm pool of base-net on the same runtime and egress (its source is closed, not the agent).
    pooled_source = TemplateSource(runtime, image, pool_sizes={"base": 0, NET_TEMPLATE: 1}, egress=egress)
    pooled_agent = NodeAgent(runtime, image, egress=egress, source=pooled_source)
    restore: list[float] = []
    cold: list[float] = []
    pooled: list[float] = []
    pooled_first: list[float] = []
    template_build = 0.0
    try:
        await agent.start()
        await agent.wait_ready()
        t0 = time.perf_counter()
        await source.net_template(256, 1)
        template_build = (time.perf_counter() - t0) * 1000
        await pooled_source.start()
        await pooled_source.wait_ready()
        for _ in range(n):
            await _pool_filled(pooled_source, NET_TEMPLATE)
            await asyncio.sleep(1.0)  # the refill's CPU use is over
            sid = new_id("sbx")
            t0 = time.perf_counter()
            record = await pooled_agent.create(sid, "base", 256, 1, {}, policy=_policy(),
                                               secrets={SECRET_ID: "v"}, session_id="ses_bench")
            t1 = time.perf_counter()
            await pooled_agent.guest(sid).exec(["true"])
            assert record.source == "pool"
            pooled.append((t1 - t0) * 1000)
            pooled_first.append((time.perf_counter() - t0) * 1000)
            await pooled_agent.destroy(sid)
        await pooled_source.close()
        for _ in range(n):
            for kind, times in (("restore", restore), ("cold", cold)):
                sid = new_id("sbx")
                t0 = time.perf_counter()
                if kind == "restore":
                    record = await agent.create(sid, "base", 256, 1, {}, policy=_policy(),
                                                secrets={SECRET_ID: "v"}, session_id="ses_bench")
                    assert record.source == "restore"
                    times.append((time.perf_counter() - t0) * 1000)
                    await agent.destroy(sid)
                else:
                    record = await cold_agent.create(sid, "base", 256, 1, {}, policy=_policy(),
                                                     secrets={SECRET_ID: "v"}, session_id="ses_bench")
                    assert record.source == "boot"
                    times.append((time.perf_counter() - t0) * 1000)
                    await cold_agent.destroy(sid)
    finally:
        await agent.close()
        pool.destroy()
        shutil.rmtree(state, ignore_errors=True)
    return {"pool_ms": summary(pooled), "pool_and_first_command_ms": summary(pooled_first),
            "restore_ms": summary(restore), "cold_boot_ms": summary(cold),
            "net_template_build_ms": round(template_build, 1),
            "cold_over_restore_p50": round(summary(cold)["p50"] / summary(restore)["p50"], 2)}


async def main(n: int, vm: bool) -> dict[str, Any]:
    tag = secrets.token_hex(2)
    result: dict[str, Any] = {"host": host_facts(), "n": n}
    result["node_egress"] = await _attach_detach(n, f"ceb{tag}-")
    result["bare_network"] = await _bare_network(n, f"cen{tag}-")
    result["secret_sealing"] = _sealing(1000)
    attach = result["node_egress"]["attach_ms"]["p50"]
    bare = result["bare_network"]["netns_tap_rules_create_ms"]["p50"]
    result["ratios"] = {"attach_over_bare_network_p50": round(attach / bare, 2)}
    if vm:
        result["vm"] = await _ca_install(5)
        result["create_with_policy"] = await _create_with_policy(3)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--vm", action="store_true", help="also time the CA install in a real guest")
    args = parser.parse_args()
    data = asyncio.run(main(args.n, args.vm))
    write_results(RESULTS, data)
    rows = [("attach (netns+rules+broker listeners+CA)", data["node_egress"]["attach_ms"]),
            ("detach", data["node_egress"]["detach_ms"]),
            ("bare netns+tap+rules create", data["bare_network"]["netns_tap_rules_create_ms"]),
            ("policy update, same domains", data["node_egress"]["update_policy_same_domains_ms"]),
            ("policy update, CA re-issued", data["node_egress"]["update_policy_ca_reissue_ms"])]
    if "vm" in data:
        rows.append(("CA install in guest trust store", data["vm"]["guest_ca_install_ms"]))
        rows.append(("create with policy: warm pool (base-net)", data["create_with_policy"]["pool_ms"]))
        rows.append(("  + first command", data["create_with_policy"]["pool_and_first_command_ms"]))
        rows.append(("create with policy: restore (base-net)", data["create_with_policy"]["restore_ms"]))
        rows.append(("create with policy: cold boot", data["create_with_policy"]["cold_boot_ms"]))
    print(f"{'ms':<45} {'p50':>9} {'p95':>9} {'max':>9}")
    for name, s in rows:
        print(f"{name:<45} {s['p50']:>9.2f} {s['p95']:>9.2f} {s['max']:>9.2f}")
    print(f"secret seal/open p50: {data['secret_sealing']['seal_us']['p50']:.1f} / "
          f"{data['secret_sealing']['open_us']['p50']:.1f} us")
    print(f"attach / bare network (p50): {data['ratios']['attach_over_bare_network_p50']}x")
    print(f"wrote {RESULTS}")

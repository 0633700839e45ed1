"""Creation paths benchmark: warm pool vs restore on demand vs cold boot; pause/resume; branch; density.

Drives the node agent (:class:`capsa.node.agent.agent.NodeAgent` with a ``TemplateSource``) directly, with
real QEMU microvms (TCG on hosts without hardware virtualization) on a btrfs loop pool in a temporary state
directory that is removed afterwards. Prints a table and writes JSON::

    .venv/bin/python bench/create_paths.py [--n 20] [--cold 5] [--out bench/results/create_paths.json]

* ``create_pool_s``: ``agent.create`` with an idle pooled sandbox (bind: reseed, clock, hostname); the
  pool is refilled between samples, outside the timing.
* ``create_restore_s``: ``agent.create`` with the pool disabled (restore of the base template on demand).
* ``cold_boot_s``: ``runtime.boot`` to guest daemon ready (what creation would cost without templates);
  fewer samples because each takes ~10 s under TCG.
* ``*_first_exec_s``: the same plus the first ``true`` run in the guest.
* ``pause_s`` / ``resume_s`` for 256 MiB and 1 GiB guests with a quarter of their RAM dirtied first.
* ``branch_s``: one snapshot into 1/4/8 sandboxes, all answering.
* ``idle_pss_mib``: PSS of idle sandboxes' QEMU processes (restored from the template, RAM reflinked and
  mapped shared; and branches, mapping the snapshot's RAM privately), and how many would fit in the
  host's available memory at that size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from capsa.common.ids import new_id
from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.source import TemplateSource
from harness import host_facts, memory_kib, summary, write_results


async def _wait_pool(agent: NodeAgent, idle: int = 1) -> None:
    while True:
        st = [s for s in agent.pool_status() if s["template"] == "base" and s["memory_mib"] == 256]
        if st and st[0]["idle"] == idle and st[0]["restoring"] == 0:
            return
        await asyncio.sleep(0.05)


async def _true(agent: NodeAgent, sid: str) -> None:
    res = await agent.get(sid).sandbox.guest.exec(["true"], timeout=60)
    assert res.exit_code == 0


async def _creates(agent: NodeAgent, n: int,
                   pooled: bool) -> tuple[list[float], list[float], list[str]]:
    create, first, sources = [], [], []
    for _ in range(n):
        if pooled:
            await _wait_pool(agent)
        sid = new_id("sbx")
        t0 = time.perf_counter()
        record = await agent.create(sid, "base", 256, 1, {})
        t1 = time.perf_counter()
        await _true(agent, sid)
        t2 = time.perf_counter()
        create.append(t1 - t0)
        first.append(t2 - t0)
        sources.append(str(record.as_dict()["source"]))
        await agent.destroy(sid)
    return create, first, sources


async def _cold(runtime: QemuRuntime, spec: VMSpec, n: int) -> tuple[list[float], list[float]]:
    boots, first = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await runtime.boot(spec)
        t1 = time.perf_counter()
        res = await sb.guest.exec(["true"], timeout=60)
        t2 = time.perf_counter()
        assert res.exit_code == 0
        boots.append(t1 - t0)
        first.append(t2 - t0)
        await runtime.destroy(sb)
    return boots, first


async def _pause_resume(agent: NodeAgent, memory_mib: int, n: int) -> dict[str, Any]:
    pauses, resumes = [], []
    for _ in range(n):
        sid = new_id("sbx")
        await agent.create(sid, "base", memory_mib, 1, {})
        dirty = memory_mib // 4
        res = await agent.get(sid).sandbox.guest.exec(
            ["sh", "-c", f"head -c {dirty}M /dev/urandom > /dev/shm/ballast && sync"], timeout=300)
        assert res.exit_code == 0, res.stderr
        t0 = time.perf_counter()
        snap = await agent.pause(sid)
        t1 = time.perf_counter()
        rid = new_id("sbx")
        await agent.restore(str(snap["id"]), rid, {})
        await _true(agent, rid)
        t2 = time.perf_counter()
        pauses.append(t1 - t0)
        resumes.append(t2 - t1)
        await agent.destroy(rid)
        agent.delete_snapshot(str(snap["id"]))
    return {"memory_mib": memory_mib, "dirty_mib": memory_mib // 4, "pause_s": summary(pauses),
            "resume_s": summary(resumes)}


def _pss_mib(sb: object) -> float | None:
    pid = getattr(sb, "pid", None)
    if pid is None:
        return None
    return memory_kib(pid)["pss"] / 1024


async def _branch(agent: NodeAgent, repeat: int) -> tuple[dict[str, Any], list[float]]:
    sid = new_id("sbx")
    await agent.create(sid, "base", 256, 1, {})
    snap = await agent.snapshot(sid)
    out: dict[str, Any] = {}
    pss: list[float] = []
    try:
        for n in (1, 4, 8):
            times = []
            for r in range(repeat):
                ids = [new_id("sbx") for _ in range(n)]
                t0 = time.perf_counter()
                await agent.branch(str(snap["id"]), ids, {})
                times.append(time.perf_counter() - t0)
                if n == 8 and r == repeat - 1:
                    await asyncio.sleep(3)
                    pss = [p for i in ids if (p := _pss_mib(agent.get(i).sandbox)) is not None]
                for i in ids:
                    await agent.destroy(i)
            out[str(n)] = summary(times)
    finally:
        await agent.destroy(sid)
    return out, pss


async def _idle_density(agent: NodeAgent, k: int) -> list[float]:
    ids = [new_id("sbx") for _ in range(k)]
    try:
        for sid in ids:
            await agent.create(sid, "base", 256, 1, {})
        await asyncio.sleep(5)
        return [p for sid in ids if (p := _pss_mib(agent.get(sid).sandbox)) is not None]
    finally:
        for sid in ids:
            await agent.destroy(sid)


def _mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def _fmt(s: dict[str, float]) -> str:
    return f"p50 {s['p50'] * 1000:8.1f} ms  p95 {s['p95'] * 1000:8.1f} ms  (n={s['n']})"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings()
    image = ensure_image(settings)
    state = Path(tempfile.mkdtemp(prefix="capsa-bench-create-", dir="/var/tmp"))
    os.chmod(state, 0o711)
    pool = StoragePool.open(state, StorageSettings(loop_size_mib=16384, require_cow=True))
    runtime = QemuRuntime(Settings(state_dir=state, cache_dir=settings.cache_dir, accel=args.accel),
                              storage=PoolStorage(pool))
    source = TemplateSource(runtime, image, pool_size=1)
    agent = NodeAgent(runtime, image, source=source,
                      capacity=NodeCapacity(memory_mib=20480, vcpus=64, max_sandboxes=64))
    results: dict[str, Any] = {"host": host_facts(), "load_start": list(os.getloadavg())}
    try:
        t0 = time.perf_counter()
        await agent.start()
        await agent.wait_ready()
        results["base_template_build_s"] = time.perf_counter() - t0

        create, first, sources = await _creates(agent, args.n, pooled=True)
        results["create_pool_s"] = summary(create)
        results["create_pool_first_exec_s"] = summary(first)
        results["create_pool_sources"] = {s: sources.count(s) for s in set(sources)}
        print("create from warm pool   ", _fmt(results["create_pool_s"]), flush=True)

        # The pool off: every creation restores the template on demand.
        await source.warm.drain()
        source.warm.default_size = 0
        create, first, sources = await _creates(agent, args.n, pooled=False)
        results["create_restore_s"] = summary(create)
        results["create_restore_first_exec_s"] = summary(first)
        results["create_restore_sources"] = {s: sources.count(s) for s in set(sources)}
        print("create, restore on demand", _fmt(results["create_restore_s"]), flush=True)

        spec = VMSpec(image=image, memory_mib=256)
        boots, first = await _cold(runtime, spec, args.cold)
        results["cold_boot_s"] = summary(boots)
        results["cold_boot_first_exec_s"] = summary(first)
        results["cold_boot_note"] = f"n={args.cold}: each cold boot takes ~10 s under TCG (time-bound)"
        print("cold boot               ", _fmt(results["cold_boot_s"]), flush=True)

        results["pause_resume"] = []
        for mem in (256, 1024):
            pr = await _pause_resume(agent, mem, args.pause_n)
            results["pause_resume"].append(pr)
            print(f"pause  {mem:5d} MiB        ", _fmt(pr["pause_s"]), flush=True)
            print(f"resume {mem:5d} MiB        ", _fmt(pr["resume_s"]), flush=True)
        results["base_1gib_template_note"] = "the 1 GiB base variant is built on first use (one cold boot)"

        branch, branch_pss = await _branch(agent, args.branch_repeat)
        results["branch_s"] = branch
        for n, s in branch.items():
            print(f"branch into {n}           ", _fmt(s), flush=True)

        pss = await _idle_density(agent, args.idle)
        avail = _mem_available_mib()
        results["idle_pss_mib"] = {
            "restored_shared_ram": summary(pss) if pss else None,
            "branches_private_ram": summary(branch_pss) if branch_pss else None,
            "mem_available_mib": avail,
            "fit_restored": int(avail // (sum(pss) / len(pss))) if pss else None,
            "fit_branches": int(avail // (sum(branch_pss) / len(branch_pss))) if branch_pss else None,
            "note": "fit = MemAvailable / mean PSS of idle sandboxes; the node also caps sandboxes by its "
                    "configured capacity",
        }
        print(f"idle PSS restored {results['idle_pss_mib']['restored_shared_ram']}", flush=True)
        print(f"idle PSS branches {results['idle_pss_mib']['branches_private_ram']}", flush=True)
        print(f"fit in {avail:.0f} MiB available: restored {results['idle_pss_mib']['fit_restored']}, "
              f"branches {results['idle_pss_mib']['fit_branches']}", flush=True)
        r = results
        results["ratios"] = {
            "restore_over_pool_p50": r["create_restore_s"]["p50"] / r["create_pool_s"]["p50"],
            "cold_over_pool_p50": r["cold_boot_s"]["p50"] / r["create_pool_s"]["p50"],
            "cold_over_restore_p50": r["cold_boot_s"]["p50"] / r["create_restore_s"]["p50"],
        }
        print("ratios", {k: round(v, 1) for k, v in results["ratios"].items()}, flush=True)
        results["load_end"] = list(os.getloadavg())
        results["peers"] = "not run by this script (no gVisor runsc / nitrobox comparison here)"
    finally:
        await agent.close()
        pool.destroy()
        shutil.rmtree(state, ignore_errors=True)
    write_results(Path(args.out), results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20, help="creations per path (pool, restore)")
    parser.add_argument("--cold", type=int, default=5, help="cold boots")
    parser.add_argument("--pause-n", type=int, default=5, help="pause/resume rounds per memory size")
    parser.add_argument("--branch-repeat", type=int, default=3)
    parser.add_argument("--idle", type=int, default=8, help="idle sandboxes for the PSS reading")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--out", default="bench/results/create_paths.json")
    asyncio.run(main(parser.parse_args()))

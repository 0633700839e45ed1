"""Where a command's time goes: `true` through the guest channel, split into channel and guest spawn.

    .venv/bin/python bench/profile_exec.py [--n 30] [--restores 3] [--accel auto]
                                           [--out bench/results/profile_exec.json]

Boots one VM with the node's driver (capsa.node.runtime.qemu) in a temporary state directory and measures,
all wall-clock in this process unless said otherwise:
- ``health``: a channel round trip with nothing spawned;
- ``exec ["true"]`` and ``exec "true"`` (through /bin/sh -c): the whole round trip;
- the guest daemon's own view of the same commands, from the exec result: ``spawn_ms`` (from before the
  spawn until the command is placed in its cgroup and released) and ``duration`` (spawn to exit), when the
  daemon reports them (older daemons do not: those rows are left out);
- after a snapshot of that VM and a restore from it (``--restores`` times): the 1st through 10th
  ``true``, to compare the first command of a restored sandbox with its tenth;
- ``node_paths`` (``--paths N``, 0 to skip): through the node agent with the production
  ``TemplateSource``, N sandboxes from the warm pool and N restored on demand, each with its 1st through
  10th ``["true"]`` (``agent.guest(sid).exec``), for two variants in the same run: ``before`` (no warm-up
  before the template snapshot, none after a restore on demand) and ``after`` (the defaults); then a node on a
  fresh state directory with the template cache the ``after`` variant filled: time until ready (the base
  template imported, no cold boot) and its first create + first ``true``.
The breakdown row "channel + host" is the round trip minus the guest-side duration. The machine is shared:
the load average is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.images.build import image_from_manifest, load_manifest
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.guestlink.client import GuestClient
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.source import TemplateSource
from harness import host_facts, write_results

__all__ = ["main"]

AFTER_RESTORE = 10


def quantiles(values: list[float]) -> dict[str, float]:
    """n, min, p50, p90, max, mean (nearest-rank p90)."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, max(0, -(-90 * len(ordered) // 100) - 1))]
    return {"n": len(ordered), "min": ordered[0], "p50": statistics.median(ordered), "p90": p90,
            "max": ordered[-1], "mean": statistics.fmean(ordered)}


async def _timed_true(sandbox: QemuSandbox, cmd: str | list[str]) -> tuple[float, dict[str, Any]]:
    """One ``true`` through the channel: the round trip in ms and the daemon's result fields."""
    client: GuestClient = await sandbox._usable_client()
    t0 = time.perf_counter()
    # The raw RESULT frame (the public ExecResult keeps only the fields every caller needs).
    frame = await client.call("exec", {"cmd": cmd})
    elapsed = (time.perf_counter() - t0) * 1000
    if frame.meta.get("exit_code") != 0:
        raise RuntimeError(f"true failed in the guest: {frame.meta}")
    return elapsed, dict(frame.meta)


async def _series(sandbox: QemuSandbox, cmd: str | list[str], n: int) -> dict[str, Any]:
    rtts: list[float] = []
    spawns: list[float] = []
    durations: list[float] = []
    for _ in range(n):
        rtt, meta = await _timed_true(sandbox, cmd)
        rtts.append(rtt)
        if isinstance(meta.get("spawn_ms"), int | float):
            spawns.append(float(meta["spawn_ms"]))
        if isinstance(meta.get("duration"), int | float):
            durations.append(float(meta["duration"]) * 1000)
    out: dict[str, Any] = {"round_trip_ms": quantiles(rtts)}
    if spawns:
        out["guest_spawn_ms"] = quantiles(spawns)
    if durations:
        out["guest_duration_ms"] = quantiles(durations)
        out["channel_and_host_ms"] = quantiles([r - d for r, d in zip(rtts, durations, strict=True)])
    return out


def _image(image_dir: Path) -> GuestImage:
    """A cached image by its folder (to compare an older build's guest code in the same run)."""
    manifest = load_manifest(image_dir)
    image = image_from_manifest(image_dir, manifest) if manifest is not None else None
    if image is None:
        raise SystemExit(f"no usable image in {image_dir}")
    return image


async def bench(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    image = _image(args.image_dir) if args.image_dir else ensure_image()
    # Snapshots need the node's storage pool (a btrfs loop file here, for reflinked RAM and disks).
    pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=8 * 1024))
    runtime = QemuRuntime(Settings(state_dir=state_dir), args.accel, storage=PoolStorage(pool))
    spec = VMSpec(image=image, memory_mib=args.memory)
    results: dict[str, Any] = {"host": host_facts(),
                               "image": {"digest": image.digest, "kernel": image.kernel_release}}
    try:
        sandbox = await runtime.boot(spec)
        results["accelerator"] = sandbox.accelerator.value
        guest = sandbox.guest
        for _ in range(5):  # warm-up: guest page cache, translation cache, Python's first calls
            await guest.exec(["true"])
        healths = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            await guest.health()
            healths.append((time.perf_counter() - t0) * 1000)
        results["health_ms"] = quantiles(healths)
        results["true_argv"] = await _series(sandbox, ["true"], args.n)
        results["true_shell"] = await _series(sandbox, "true", args.n)

        snap = await runtime.snapshot(sandbox, resume=True)
        await runtime.destroy(sandbox)
        per_index: list[list[float]] = [[] for _ in range(AFTER_RESTORE)]
        restores: list[float] = []
        for _ in range(args.restores):
            t0 = time.perf_counter()
            restored = await runtime.restore(snap, spec)
            restores.append((time.perf_counter() - t0) * 1000)
            for i in range(AFTER_RESTORE):
                rtt, _meta = await _timed_true(restored, ["true"])
                per_index[i].append(rtt)
            await runtime.destroy(restored)
        runtime.delete_snapshot(snap)
        results["restore_ms"] = quantiles(restores)
        results["after_restore_true_ms"] = {str(i + 1): quantiles(v) for i, v in enumerate(per_index)}
    finally:
        await runtime.close()
        pool.destroy()
    if args.paths:
        results["node_paths"] = await node_paths(args, image, state_dir / "paths")
    results["host"]["loadavg_at_end"] = list(os.getloadavg())
    return results


async def _wait_pool(source: TemplateSource) -> None:
    for _ in range(1200):
        status = source.pool_status()
        if status and int(str(status[0]["idle"])) >= 1 and status[0]["restoring"] == 0:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the warm pool did not fill in 60 s")


async def _agent_series(agent: NodeAgent, source: TemplateSource, n: int, pooled: bool) -> dict[str, Any]:
    """n creates, each followed by AFTER_RESTORE ``["true"]`` through the agent: create ms and per-index
    exec ms."""
    creates: list[float] = []
    per_index: list[list[float]] = [[] for _ in range(AFTER_RESTORE)]
    sources: list[str] = []
    for _ in range(n):
        if pooled:
            await _wait_pool(source)
        sid = new_id("sbx")
        t0 = time.perf_counter()
        record = await agent.create(sid, "base", 256, 1, {})
        creates.append((time.perf_counter() - t0) * 1000)
        sources.append(record.source)
        for i in range(AFTER_RESTORE):
            t1 = time.perf_counter()
            result = await agent.guest(sid).exec(["true"])
            per_index[i].append((time.perf_counter() - t1) * 1000)
            if result.exit_code != 0:
                raise RuntimeError(f"true failed: {result}")
        await agent.destroy(sid)
    return {"create_ms": quantiles(creates), "sources": {s: sources.count(s) for s in set(sources)},
            "true_ms": {str(i + 1): quantiles(v) for i, v in enumerate(per_index)}}


def _node(state_dir: Path, image: GuestImage, accel: str, **source_args: Any
          ) -> tuple[StoragePool, TemplateSource, NodeAgent]:
    state_dir.mkdir(mode=0o711, parents=True)
    os.chmod(state_dir.parent, 0o711)  # QEMU runs as an unprivileged uid and must reach its folder
    pool = StoragePool.open(state_dir, StorageSettings(loop_size_mib=8 * 1024))
    runtime = QemuRuntime(Settings(state_dir=state_dir), accel, storage=PoolStorage(pool))
    source = TemplateSource(runtime, image, **source_args)
    agent = NodeAgent(runtime, image, source=source, capacity=NodeCapacity(8192, 16, 16))
    return pool, source, agent


async def node_paths(args: argparse.Namespace, image: GuestImage, base_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cache = TemplateCache(base_dir / "cache")
    variants: dict[str, dict[str, Any]] = {
        "before": {"warm_up_rounds": 0, "warm_restores": False},
        "after": {"cache": cache},
    }
    for name, opts in variants.items():
        pool, source, agent = _node(base_dir / name, image, args.accel, pool_size=1, **opts)
        try:
            t0 = time.perf_counter()
            await agent.start()
            await agent.wait_ready()
            row: dict[str, Any] = {"options": {k: v for k, v in opts.items() if k != "cache"},
                                   "base_template_build_ms": (time.perf_counter() - t0) * 1000}
            row["pool"] = await _agent_series(agent, source, args.paths, pooled=True)
            await source.warm.drain()
            source.warm.default_size = 0
            row["restore_on_demand"] = await _agent_series(agent, source, args.paths, pooled=False)
            await source.store.wait_published()
            out[name] = row
        finally:
            await agent.close()
            pool.destroy()
    # A node on an empty state directory, the template cache warm: ready without a cold boot.
    pool, source, agent = _node(base_dir / "fresh", image, args.accel, pool_size=0, cache=cache)
    try:
        t0 = time.perf_counter()
        await agent.start()
        await agent.wait_ready()
        ready = (time.perf_counter() - t0) * 1000
        sid = new_id("sbx")
        t1 = time.perf_counter()
        record = await agent.create(sid, "base", 256, 1, {})
        created = (time.perf_counter() - t1) * 1000
        first = await agent.guest(sid).exec(["true"])
        first_ms = (time.perf_counter() - t1) * 1000 - created
        out["fresh_node"] = {"ready_ms": ready, "imports": source.store.imports,
                             "cold_boots": 0 if source.store.imports else 1, "first_create_ms": created,
                             "first_true_ms": first_ms, "source": record.source,
                             "first_exit_code": first.exit_code}
    finally:
        await agent.close()
        pool.destroy()
    return out


def print_table(results: dict[str, Any]) -> None:
    table = Table(title=f"exec profile (accelerator: {results['accelerator']})")
    for col in ("measure", "n", "p50", "p90", "min", "max"):
        table.add_column(col, justify="left" if col == "measure" else "right")

    def row(label: str, s: dict[str, float] | None) -> None:
        if s:
            table.add_row(label, str(s["n"]), f"{s['p50']:.1f}", f"{s['p90']:.1f}", f"{s['min']:.1f}",
                          f"{s['max']:.1f}")

    row("health round trip (channel only), ms", results["health_ms"])
    load = results["host"]["loadavg_at_start"][0]
    table.caption = f"image {results['image']['digest'][:12]}, load average at start {load:.2f}"
    for key, label in (("true_argv", 'exec ["true"]'), ("true_shell", 'exec "true" (sh -c)')):
        series = results[key]
        row(f"{label}: round trip, ms", series["round_trip_ms"])
        row(f"{label}: guest spawn, ms", series.get("guest_spawn_ms"))
        row(f"{label}: guest spawn to exit, ms", series.get("guest_duration_ms"))
        row(f"{label}: channel + host, ms", series.get("channel_and_host_ms"))
    row("restore from snapshot to daemon answering, ms", results["restore_ms"])
    after = results["after_restore_true_ms"]
    for i in ("1", "2", "10"):
        row(f'after restore: exec ["true"] #{i}, ms', after[i])
    for variant, paths in results.get("node_paths", {}).items():
        if variant == "fresh_node":
            continue
        for path in ("pool", "restore_on_demand"):
            series = paths[path]
            row(f"{variant}: {path} create, ms", series["create_ms"])
            for i in ("1", "2", "10"):
                row(f'{variant}: {path} agent.guest(sid).exec ["true"] #{i}, ms', series["true_ms"][i])
    Console().print(table)
    fresh = results.get("node_paths", {}).get("fresh_node")
    if fresh:
        print(f"fresh node, template cache warm: ready in {fresh['ready_ms']:.0f} ms "
              f"(imports {fresh['imports']}), first create {fresh['first_create_ms']:.0f} ms "
              f"({fresh['source']}), first true {fresh['first_true_ms']:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="commands per series")
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--paths", type=int, default=5,
                        help="sandboxes per node path (pool, restore on demand) and variant; 0: skip")
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--image-dir", type=Path, default=None,
                        help="a cached image folder instead of the current build (before/after runs)")
    parser.add_argument("--accel", default="auto", choices=["auto", "kvm", "tcg"])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "profile_exec.json")
    args = parser.parse_args()
    if args.n < 1 or args.restores < 1:
        parser.error("--n and --restores must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("qemu").setLevel(logging.CRITICAL)
    state_dir = Path(tempfile.mkdtemp(prefix="cprofile-", dir="/var/tmp"))
    os.chmod(state_dir, 0o711)  # QEMU runs as an unprivileged uid and must reach its folder
    try:
        results = asyncio.run(bench(args, state_dir))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    results["parameters"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_results(args.out, results)
    print_table(results)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

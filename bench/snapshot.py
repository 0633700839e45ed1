"""Snapshot benchmark: save and restore for 256 MiB and 1 GiB guests, branch into 1/4/8 clones.

Runs real QEMU microvms (TCG on hosts without hardware virtualization) on a btrfs loop pool it creates
in a temporary state directory, and removes everything afterwards. Prints a table and writes JSON::

    .venv/bin/python bench/snapshot.py [--out bench/results/snapshot.json] [--repeat 5]

All figures are wall-clock seconds measured in this process, from the request to the guest daemon
answering (restore and branch include the entropy reseed and clock push). Memory is the PSS of each
QEMU process (shared page cache split between the clones that map it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.hostinfo import qemu_version
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.runtime.snapshot.manifest import Snapshot
from capsa.node.runtime.snapshot.mechanics import RamMode
from capsa.node.storage import StoragePool, StorageSettings

_T = TypeVar("_T")

# Before every save, rewrite ~1/4 of the guest's RAM (a tmpfs file of random bytes): a save then has that
# much memory dirtied since the previous one, instead of measuring an idle guest with a clean page cache.
_DIRTY = "head -c {mib}M /dev/urandom > /dev/shm/ballast && sync"


async def _dirty(sb: QemuSandbox, mib: int) -> None:
    res = await sb.guest.exec(["sh", "-c", _DIRTY.format(mib=mib)], timeout=300)
    assert res.exit_code == 0, res.stderr


def _pss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"n": len(values), "min": ordered[0], "p50": statistics.median(ordered), "p95": p95,
            "max": ordered[-1], "mean": statistics.fmean(ordered)}


async def _timed(coro: Awaitable[_T]) -> tuple[_T, float]:
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started


async def _answering(sb: QemuSandbox) -> None:
    res = await sb.guest.exec(["true"], timeout=30)
    assert res.exit_code == 0


async def bench_size(rt: QemuRuntime, spec: VMSpec, repeat: int, out: dict[str, Any]) -> Snapshot:
    mib = spec.memory_mib
    sb, boot_s = await _timed(rt.boot(spec))
    assert isinstance(sb, QemuSandbox)
    await _answering(sb)
    rolling: list[float] = []
    for _ in range(repeat):
        await _dirty(sb, mib // 4)
        snap, secs = await _timed(rt.snapshot(sb, resume=True))
        rolling.append(secs)
        rt.delete_snapshot(snap)
    await _dirty(sb, mib // 4)
    pause, pause_s = await _timed(rt.snapshot(sb, resume=False))
    await rt.destroy(sb)
    saves = [pause_s]
    restores: dict[str, list[float]] = {m.value: [] for m in RamMode}
    current = pause
    for i in range(repeat):
        for mode in RamMode:
            restored, secs = await _timed(rt.restore(current, spec, ram_mode=mode))
            await _answering(restored)
            restores[mode.value].append(secs)
            if mode is RamMode.COPY and i < repeat - 1:
                # Pause again from the restored VM (RAM is a reflinked shared file: the fast path).
                await _dirty(restored, mib // 4)
                nxt, secs = await _timed(rt.snapshot(restored, resume=False))
                saves.append(secs)
                await rt.destroy(restored)
                if current is not pause:
                    rt.delete_snapshot(current)
                current = nxt
            else:
                await rt.destroy(restored)
    if current is not pause:
        rt.delete_snapshot(current)
    m = pause.manifest
    out[f"{mib}MiB"] = {
        "cold_boot_s": boot_s,
        "pause_save_s": _summary(saves),
        "rolling_save_s": _summary(rolling),
        "restore_s": {mode: _summary(v) for mode, v in restores.items()},
        "state_bytes": m.device_state.size,
        "ram_bytes": m.ram.size if m.ram else None,
        "ram_allocated_bytes": (pause.path / m.ram.path).stat().st_blocks * 512 if m.ram else None,
    }
    return pause


async def bench_branch(rt: QemuRuntime, snap: Snapshot, spec: VMSpec, counts: list[int], repeat: int,
                       out: dict[str, Any]) -> None:
    for mode in RamMode:
        for n in counts:
            times: list[float] = []
            pss: list[int] = []
            for _ in range(repeat):
                clones, secs = await _timed(rt.branch(snap, n, spec, ram_mode=mode))
                times.append(secs)
                await asyncio.gather(*(_answering(c) for c in clones))
                pss.extend(v for c in clones if (v := _pss_kib(c.pid)) is not None)
                await asyncio.gather(*(rt.destroy(c) for c in clones))
            out[f"{mode.value}_x{n}"] = {"seconds": _summary(times),
                                         "per_clone_s": times and statistics.median(times) / n,
                                         "pss_kib_per_clone": statistics.median(pss) if pss else None}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "snapshot.json")
    ap.add_argument("--sizes", default="256,1024", help="guest memory sizes in MiB")
    ap.add_argument("--branches", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--accel", default=None, help="auto|kvm|tcg (default: CAPSA_ACCEL or auto)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(n) for n in args.branches.split(",")]

    image = ensure_image()
    state = Path(tempfile.mkdtemp(prefix="capsa-bench-", dir="/var/tmp"))
    os.chmod(state, 0o711)  # QEMU runs as its own uid and must reach its files in the pool
    pool = StoragePool.open(state, StorageSettings(loop_size_mib=32 * 1024))
    rt = QemuRuntime(Settings(state_dir=state), args.accel, storage=PoolStorage(pool))
    results: dict[str, Any] = {
        "benchmark": "snapshot",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(), "qemu": qemu_version(),
                 "pool_fstype": pool.fstype, "pool_cow": pool.cow},
        "image_digest": image.digest,
        "sizes": {},
        "branch": {},
    }
    try:
        branch_snap: Snapshot | None = None
        for mib in sizes:
            snap = await bench_size(rt, VMSpec(image=image, memory_mib=mib), args.repeat, results["sizes"])
            if mib == min(sizes):
                branch_snap = snap
            else:
                rt.delete_snapshot(snap)
        results["accel"] = rt.accelerator.value if rt.accelerator else None
        assert branch_snap is not None
        await bench_branch(rt, branch_snap, VMSpec(image=image, memory_mib=min(sizes)), counts, args.repeat,
                           results["branch"])
        results["branch"]["memory_mib"] = min(sizes)
    finally:
        await rt.close()
        pool.destroy()
        shutil.rmtree(state, ignore_errors=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"accel {results.get('accel')}, qemu {results['host']['qemu']}, pool {pool.fstype} cow={pool.cow}")
    print(f"{'guest':>8} {'cold boot':>10} {'pause p50':>10} {'rolling p50':>12} {'restore copy':>13} "
          f"{'restore private':>16} {'state KiB':>10}")
    for name, r in results["sizes"].items():
        print(f"{name:>8} {r['cold_boot_s']:>10.2f} {r['pause_save_s']['p50']:>10.3f} "
              f"{r['rolling_save_s']['p50']:>12.3f} {r['restore_s']['copy']['p50']:>13.3f} "
              f"{r['restore_s']['private']['p50']:>16.3f} {r['state_bytes'] / 1024:>10.0f}")
    print(f"{'branch':>12} {'p50 s':>8} {'p95 s':>8} {'PSS/clone MiB':>14}")
    for name, r in results["branch"].items():
        if isinstance(r, dict):
            pss = r["pss_kib_per_clone"]
            print(f"{name:>12} {r['seconds']['p50']:>8.3f} {r['seconds']['p95']:>8.3f} "
                  f"{(pss / 1024 if pss else float('nan')):>14.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

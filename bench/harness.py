"""Small helpers shared by the benchmarks: summaries, host facts, process memory, JSON + table output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["cpu_seconds", "host_facts", "memory_kib", "pool_settled", "qemu_pids", "summary", "write_results"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def summary(values: list[float]) -> dict[str, float]:
    """n, min, p50, p95, max, mean of ``values`` (nearest-rank p95)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, max(0, -(-95 * len(ordered) // 100) - 1))]
    return {"n": len(ordered), "min": ordered[0], "p50": statistics.median(ordered), "p95": p95,
            "max": ordered[-1], "mean": statistics.fmean(ordered)}


def memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss (proportional: shared pages divided among their users), private and shared pages of a
    process, in KiB (USS is private_clean + private_dirty)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Shared_Clean", "Shared_Dirty"):
            out[key.lower()] = int(rest.split()[0])
    return out


def guest_ram_pss_kib(pid: int) -> int:
    """PSS (KiB) of the mappings of QEMU ``pid`` that hold its guest's RAM (the RAM file, or the sealed
    memfd copy of a frozen one, plus the copy-on-write pages written over it); the rest of its PSS is
    QEMU's own (code, heap, TCG's translation cache)."""
    total, ram = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else ""
            ram = name.endswith("memory.ram") or name.startswith("/memfd:capsa-ram")
        elif ram and parts[0] == "Pss:":
            total += int(parts[1])
    return total


def mem_available_mib() -> float:
    """The host's MemAvailable, in MiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def host_facts() -> dict[str, Any]:
    from capsa.node.runtime.hostinfo import qemu_version

    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "qemu": qemu_version(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def qemu_pids(state: Path) -> list[int]:
    """QEMU processes whose command line names a path under ``state`` (a node's own VMs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("qemu-system"):
                continue
            if str(state) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (0 once it is gone)."""
    try:
        fields = _stat(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def pool_settled(state: Path, live: int, limit_s: float = 1800.0, quiet_s: float = 5.0,
                       quiet_cpu_s: float = 0.5) -> None:
    """Wait until one more QEMU than the ``live`` sessions runs under ``state`` and has gone idle (under
    ``quiet_cpu_s`` of CPU over ``quiet_s``): the warm pool's VM is restored and warmed up."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        pids = qemu_pids(state)
        if len(pids) > live:
            with contextlib.suppress(OSError):
                newest = max(pids, key=lambda p: int(_stat(p)[19]))  # start time
                before = cpu_seconds(newest)
                await asyncio.sleep(quiet_s)
                if cpu_seconds(newest) - before < quiet_cpu_s:
                    return
                continue
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the pool did not refill within {limit_s:.0f} s")

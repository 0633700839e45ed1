"""Small helpers shared by the benchmarks: summaries, host facts, process memory, JSON + table output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["host_facts", "memory_kib", "summary", "write_results"]


def summary(values: list[float]) -> dict[str, float]:
    """n, min, p50, p95, max, mean of ``values`` (nearest-rank p95)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, max(0, -(-95 * len(ordered) // 100) - 1))]
    return {"n": len(ordered), "min": ordered[0], "p50": statistics.median(ordered), "p95": p95,
            "max": ordered[-1], "mean": statistics.fmean(ordered)}


def memory_kib(pid: int) -> dict[str, int]:
    """Rss and Pss (proportional: shared pages divided among their users) of a process, in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Private_Dirty", "Shared_Clean"):
            out[key.lower()] = int(rest.split()[0])
    return out


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

"""Density: how many idle sessions one node holds through ``capsa serve`` with default settings, what they
cost in host CPU while idle, and what they do to a command's latency through the API.

Runs the real product path in one process (``capsa.serve.run``: control plane + local node, embedded
SQLite, default capacity and warm pool), driven by the SDK:

1. ``true`` through the API on a node holding one session (``--execs`` times): the empty-node baseline;
2. ``--sessions`` more sessions created and left idle (each runs one ``true`` first, so it is a live,
   used sandbox, not only a bound one);
3. host CPU of everything capsa runs (this process and every QEMU it started, from ``/proc/<pid>/stat``)
   over ``--idle`` seconds while they idle, as a share of the machine (all CPUs); the whole machine's busy
   share over the same interval is stored beside it (other work on the host shows there, not in the first);
4. ``true`` through the API again with all of them idle, and the ratio to step 1;
5. PSS and USS of the QEMU processes (sum and per sandbox; the guest RAM mappings' share apart) and the
   host's MemAvailable before and with them.

Writes ``bench/results/density.json``. Sessions are closed at the end and the state dir removed.
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

from capsa.common.service import run_service
from capsa.sdk import AsyncSession
from capsa.sdk.errors import CapsaAPIError, RateLimited
from harness import (
    cpu_seconds,
    guest_ram_pss_kib,
    host_facts,
    mem_available_mib,
    memory_kib,
    qemu_pids,
    summary,
    write_results,
)
from session_ops import serving

RESULTS = Path(__file__).with_name("results") / "density.json"


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


async def _create(url: str, key: str, memory_mib: int) -> AsyncSession:
    while True:
        try:
            return await AsyncSession.create(timeout=7200, memory_mib=memory_mib, api_url=url, api_key=key)
        except RateLimited as exc:
            await asyncio.sleep(exc.retry_after or 1.0)


async def _trues(session: AsyncSession, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        result = await session.commands.run("true")
        out.append(time.perf_counter() - start)
        assert result.exit_code == 0
    return out


async def measure(state: Path, accel: str, sessions: int, execs: int, idle_s: float,
                  memory_mib: int) -> dict[str, Any]:
    out: dict[str, Any] = {"host_available_mib_before": mem_available_mib()}
    async with serving(state, accel) as (url, key, made):
        probe = await _create(url, key, memory_mib)
        made.append(probe)
        await _trues(probe, 5)
        out["true_api_empty_s"] = summary(await _trues(probe, execs))
        create_s: list[float] = []
        refused: str | None = None
        for i in range(sessions):
            start = time.perf_counter()
            try:
                s = await _create(url, key, memory_mib)
            except CapsaAPIError as exc:
                refused = f"session {i + 2} refused: {exc}"
                break
            made.append(s)
            await s.commands.run("true")
            create_s.append(time.perf_counter() - start)
            if (i + 1) % 25 == 0:
                print(f"  {i + 1} idle sessions", flush=True)
        out["idle_sessions"] = len(made) - 1
        out["refused"] = refused
        out["create_and_first_true_s"] = summary(create_s)
        await asyncio.sleep(10)  # let the pool refill and the last guests settle before measuring idle cost
        pids = qemu_pids(state)
        ours = [os.getpid(), *pids]
        cpu0 = sum(cpu_seconds(p) for p in ours)
        busy0, total0 = _machine_busy()
        t0 = time.monotonic()
        await asyncio.sleep(idle_s)
        elapsed = time.monotonic() - t0
        cpu1 = sum(cpu_seconds(p) for p in ours)
        busy1, total1 = _machine_busy()
        ncpu = os.cpu_count() or 1
        out["qemu_processes"] = len(pids)
        out["idle_cpu_share_capsa"] = round((cpu1 - cpu0) / (elapsed * ncpu), 4)
        out["idle_cpu_share_machine"] = round((busy1 - busy0) / (total1 - total0), 4)
        out["idle_cpu_share_per_session"] = round(out["idle_cpu_share_capsa"] / max(1, len(made)), 6)
        mem = [memory_kib(p) for p in pids]
        pss = [m.get("pss", 0) for m in mem]
        per = max(1, len(pids)) * 1024
        out["qemu_pss_mib_total"] = round(sum(pss) / 1024, 1)
        out["qemu_pss_mib_per_sandbox"] = round(sum(pss) / per, 1)
        out["qemu_uss_mib_per_sandbox"] = round(
            sum(m.get("private_clean", 0) + m.get("private_dirty", 0) for m in mem) / per, 1)
        out["guest_ram_pss_mib_per_sandbox"] = round(sum(guest_ram_pss_kib(p) for p in pids) / per, 1)
        out["host_available_mib_loaded"] = mem_available_mib()
        out["true_api_loaded_s"] = summary(await _trues(probe, execs))
        out["true_api_loaded_vs_empty"] = round(
            out["true_api_loaded_s"]["p50"] / out["true_api_empty_s"]["p50"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=150, help="idle sessions to add (default 150)")
    parser.add_argument("--execs", type=int, default=50, help="`true` round trips per measurement")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of idle CPU measurement")
    parser.add_argument("--memory", type=int, default=256, help="guest memory MiB (the default session's)")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="capsa-density-", dir="/var/tmp"))
    state.chmod(0o755)
    try:
        facts = host_facts()
        result: dict[str, Any] = {}

        async def run() -> None:
            result.update(await measure(state, args.accel, args.sessions, args.execs, args.idle, args.memory))

        # SIGTERM/SIGINT cancel the run and its cleanup closes every session and stops serve (150 VMs
        # must not outlive an interrupted benchmark).
        run_service(run())
        if not result:
            raise SystemExit("interrupted: nothing measured")
    finally:
        shutil.rmtree(state, ignore_errors=True)
    data = {"host": facts, "end_load": os.getloadavg(), "args": vars(args) | {"out": str(args.out)},
            **result}
    write_results(args.out, data)
    for name, value in result.items():
        print(f"{name:34} {value}")


if __name__ == "__main__":
    main()

"""Runtime benchmark: cold boot, exec round trip, file throughput and idle memory of QEMU microVMs.

    .venv/bin/python bench/run_runtime.py [--boots 5] [--execs 200] [--file-mib 64] [--accel auto]
                                          [--out bench/results/runtime.json]

Boots real VMs with the same driver the node uses (capsa.node.runtime.qemu), in a temporary state
directory that is removed afterwards. All times are wall-clock, measured in this process:
- cold boot: ``runtime.boot()`` from the call to the guest daemon answering ``health`` (includes the
  private disk copy and QEMU start), then ``destroy()``;
- exec: ``guest.exec(["true"])`` round trips (a process is spawned in the guest each time), and
  ``guest.health()`` round trips (the channel alone, nothing spawned);
- files: ``write_file``/``read_file`` of random data through the channel, in MiB/s, and a command's
  stdout streamed back (``head -c N /dev/zero``) for comparison;
- memory: RSS and PSS of the QEMU process of an idle VM after the daemon answered and a few execs.
The machine is shared and the numbers move with its load; the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime
from harness import host_facts, memory_kib, summary, write_results

MIB = 1024 * 1024


async def bench(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    settings = Settings(state_dir=state_dir)
    image = ensure_image(settings)
    runtime = QemuRuntime(settings, accel=args.accel)
    spec = VMSpec(image=image, memory_mib=args.memory)
    results: dict[str, Any] = {"host": host_facts(), "image": {"digest": image.digest,
                                                               "kernel": image.kernel_release}}
    try:
        boots: list[float] = []
        destroys: list[float] = []
        cow: bool | None = None
        for i in range(args.boots):
            t0 = time.perf_counter()
            sandbox = await runtime.boot(spec)
            boots.append(time.perf_counter() - t0)
            cow = sandbox.files.disk_cow
            print(f"boot {i + 1}/{args.boots}: {boots[-1]:.2f} s ({sandbox.accelerator.value})", flush=True)
            if i < args.boots - 1:
                t0 = time.perf_counter()
                await runtime.destroy(sandbox)
                destroys.append(time.perf_counter() - t0)
        decision = runtime.accel_decision
        results["accelerator"] = {"used": sandbox.accelerator.value,
                                  "reason": decision.reason if decision else None}
        results["cold_boot_s"] = summary(boots)
        results["cold_boot_s"]["disk_cow"] = cow
        results["destroy_s"] = summary(destroys) if destroys else None

        await asyncio.sleep(args.idle)
        assert sandbox.pid is not None
        mem = memory_kib(sandbox.pid)
        results["idle_vm_memory"] = {"guest_memory_mib": args.memory, "rss_mib": mem["rss"] / 1024,
                                     "pss_mib": mem["pss"] / 1024,
                                     "private_dirty_mib": mem.get("private_dirty", 0) / 1024}

        guest = sandbox.guest
        for _ in range(10):  # warm-up: page cache in the guest, Python's first-call costs
            await guest.exec(["true"])
        execs = []
        for _ in range(args.execs):
            t0 = time.perf_counter()
            r = await guest.exec(["true"])
            execs.append((time.perf_counter() - t0) * 1000)
            assert r.exit_code == 0
        results["exec_true_ms"] = summary(execs)
        healths = []
        for _ in range(args.execs):
            t0 = time.perf_counter()
            await guest.health()
            healths.append((time.perf_counter() - t0) * 1000)
        results["health_rtt_ms"] = summary(healths)

        payload = os.urandom(args.file_mib * MIB)
        writes, reads = [], []
        for i in range(3):
            path = f"/tmp/bench-{i}.bin"
            t0 = time.perf_counter()
            await guest.write_file(path, payload)
            writes.append(args.file_mib / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            back = await guest.read_file(path)
            reads.append(args.file_mib / (time.perf_counter() - t0))
            assert back == payload
            await guest.remove(path)
        del payload, back
        streams = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = await guest.exec(["head", "-c", f"{args.file_mib}M", "/dev/zero"],
                                 max_output=args.file_mib * MIB)
            streams.append(args.file_mib / (time.perf_counter() - t0))
            assert len(r.stdout) == args.file_mib * MIB
        results["exec_stdout_mib_s"] = summary(streams) | {"file_mib": args.file_mib}
        results["file_write_mib_s"] = summary(writes) | {"file_mib": args.file_mib}
        results["file_read_mib_s"] = summary(reads) | {"file_mib": args.file_mib}

        mem = memory_kib(sandbox.pid)
        # After the execs and 3 x file-mib of files in the guest's tmpfs: guest page cache and the TCG
        # translation cache have grown.
        results["vm_memory_after_workload"] = {"rss_mib": mem["rss"] / 1024, "pss_mib": mem["pss"] / 1024}
        results["host"]["loadavg_at_end"] = list(os.getloadavg())
    finally:
        await runtime.close()
    return results


def print_table(results: dict[str, Any]) -> None:
    table = Table(title=f"capsa runtime benchmark (accelerator: {results['accelerator']['used']})")
    for col in ("measure", "n", "p50", "p95", "min", "max", "unit"):
        table.add_column(col, justify="left" if col == "measure" else "right")

    def row(label: str, key: str, unit: str) -> None:
        s = results.get(key)
        if s:
            table.add_row(label, str(s["n"]), f"{s['p50']:.2f}", f"{s['p95']:.2f}", f"{s['min']:.2f}",
                          f"{s['max']:.2f}", unit)

    row("cold boot to daemon ready", "cold_boot_s", "s")
    row("destroy", "destroy_s", "s")
    row("exec `true` round trip", "exec_true_ms", "ms")
    row("health round trip (channel only)", "health_rtt_ms", "ms")
    row(f"file write ({results['file_write_mib_s']['file_mib']} MiB)", "file_write_mib_s", "MiB/s")
    row(f"file read ({results['file_read_mib_s']['file_mib']} MiB)", "file_read_mib_s", "MiB/s")
    row(f"exec stdout stream ({results['exec_stdout_mib_s']['file_mib']} MiB)", "exec_stdout_mib_s", "MiB/s")
    mem = results["idle_vm_memory"]
    table.add_row(f"idle VM host memory ({mem['guest_memory_mib']} MiB guest)", "1",
                  f"PSS {mem['pss_mib']:.0f}", f"RSS {mem['rss_mib']:.0f}", "", "", "MiB")
    after = results["vm_memory_after_workload"]
    table.add_row("same VM after the exec/file workload", "1", f"PSS {after['pss_mib']:.0f}",
                  f"RSS {after['rss_mib']:.0f}", "", "", "MiB")
    Console().print(table)
    print(f"accelerator reason: {results['accelerator']['reason']}")
    print(f"private disk copy-on-write: {results['cold_boot_s']['disk_cow']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--file-mib", type=int, default=64)
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle before measuring memory")
    parser.add_argument("--accel", default="auto", choices=["auto", "kvm", "tcg"])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "runtime.json")
    args = parser.parse_args()
    if args.boots < 1 or args.execs < 1 or args.file_mib < 1:
        parser.error("--boots, --execs and --file-mib must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("qemu").setLevel(logging.CRITICAL)
    logging.getLogger("capsa.node.storage.disks").setLevel(logging.ERROR)
    state_dir = Path(tempfile.mkdtemp(prefix="cbench-", dir="/tmp"))
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

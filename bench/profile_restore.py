"""Where a restore on demand's time goes under TCG: QEMU start, state load, the guest waking up, and the
translation QEMU must redo in every new process.

    .venv/bin/python bench/profile_restore.py [--restores 8] [--accel auto] [--kernel-arg ARG ...]
                                              [--out bench/results/profile_restore.json]

Boots one VM with the node's driver, runs the template warm-up (``capsa.node.templates.store.warm_up``, two
rounds, as a template build does), snapshots it with its RAM in a file (as templates are) and restores it
``--restores`` times, RAM mapped as sessions' are by default (``RamMode.COPY``). For each restore:

- the launch phases the runtime logs (files, QEMU start to its monitor, monitor to the guest daemon
  answering ``health``) and the whole ``restore()`` (which also reseeds the guest RNG and sets its clock);
- how many translation blocks (TBs) QEMU's TCG holds at that point, read from the monitor
  (HMP ``info jit``: a restored VM starts with none: the translation cache is per process);
- then, alternating between restores: the first ten ``true`` with no warm-up (``cold``), or the
  restore-on-demand warm-up (one round of ``WARM_UP_COMMANDS``) followed by the first ten ``true``
  (``warmed``), each command with the TBs it added.

``ms_per_new_tb`` divides the first ``true``'s extra time over the tenth by the TBs it translated: a
rough cost of translating (and first running) one block on this host. ``--kernel-arg`` appends guest
kernel arguments to the VM (e.g. ``mitigations=off``) to compare their effect on the counts. Results are
for this host at this hour: under TCG they move with the host's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.runtime.base import RamMode, VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime, QemuSandbox
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.store import warm_up
from harness import host_facts, summary, write_results

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results" / "profile_restore.json"
COMMANDS = 10
_PHASES = re.compile(r"launch phases of (\S+): files ([\d.]+)s, qemu to QMP ([\d.]+)s, "
                     r"QMP to guest ready ([\d.]+)s")


class _Phases(logging.Handler):
    """Collects the launch phases the QEMU driver logs at debug level, by sandbox id."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: dict[str, tuple[float, float, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = _PHASES.search(record.getMessage())
        if match:
            self.seen[match.group(1)] = (float(match.group(2)), float(match.group(3)), float(match.group(4)))


async def tb_count(sandbox: QemuSandbox) -> int:
    """Translation blocks in the VM's TCG cache (HMP ``info jit``); -1 when the monitor does not say."""
    out = await sandbox.process.qmp("human-monitor-command", {"command-line": "info jit"})
    for line in str(out).splitlines():
        if line.startswith("TB count"):
            return int(line.split()[-1])
    return -1


async def _timed(sandbox: QemuSandbox, step: Awaitable[object]) -> tuple[float, int]:
    """Seconds ``step`` (not yet started: a coroutine) took and the TBs it added."""
    before = await tb_count(sandbox)
    t = time.perf_counter()
    await step
    took = time.perf_counter() - t
    return took, await tb_count(sandbox) - before


async def _commands(sandbox: QemuSandbox) -> list[tuple[float, int]]:
    """The first :data:`COMMANDS` ``true`` (through /bin/sh -c, as the SDK sends a string): seconds and
    TBs added by each."""
    return [await _timed(sandbox, sandbox.guest.exec("true")) for _ in range(COMMANDS)]


async def profile(state: Path, accel: str, restores: int, kernel_args: list[str]) -> dict[str, Any]:
    phases = _Phases()
    launch_log = logging.getLogger("capsa.node.runtime.qemu.launch")
    launch_log.addHandler(phases)
    launch_log.setLevel(logging.DEBUG)
    pool = StoragePool.open(state / "pool", StorageSettings(loop_size_mib=8 * 1024))
    runtime = QemuRuntime(Settings(state_dir=state / "runtime"), accel=accel, accel_cache=False,
                          storage=PoolStorage(pool))
    rows: list[dict[str, Any]] = []
    try:
        spec = VMSpec(image=ensure_image(Settings()), kernel_args=tuple(kernel_args))
        booted = await runtime.boot(spec)
        accelerator = str(booted.accelerator)
        await warm_up(booted, rounds=2)
        snap = await runtime.snapshot(booted, resume=False)
        await runtime.destroy(booted)
        for i in range(restores):
            variant = "cold" if i % 2 == 0 else "warmed"
            t = time.perf_counter()
            sandbox = await runtime.restore(snap, spec, ram_mode=RamMode.COPY)
            restored = time.perf_counter() - t
            row: dict[str, Any] = {"variant": variant, "restore_s": restored,
                                   "tb_at_restored": await tb_count(sandbox)}
            files, to_qmp, to_ready = phases.seen.get(sandbox.id, (float("nan"),) * 3)
            row.update(files_s=files, qemu_to_qmp_s=to_qmp, qmp_to_ready_s=to_ready)
            if variant == "warmed":
                row["warm_up_s"], row["warm_up_tb"] = await _timed(
                    sandbox, warm_up(sandbox, rounds=1, strict=True))
            row["commands"] = await _commands(sandbox)
            rows.append(row)
            await runtime.destroy(sandbox)
        runtime.delete_snapshot(snap)
    finally:
        await runtime.close()
        pool.destroy()
        launch_log.removeHandler(phases)
    return {"accelerator": accelerator, "kernel_args": kernel_args, "restores": rows,
            "summary": _summarize(rows)}


def _summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("restore_s", "qemu_to_qmp_s", "qmp_to_ready_s", "tb_at_restored"):
        out[key] = summary([r[key] for r in rows])
    for variant in ("cold", "warmed"):
        picked = [r for r in rows if r["variant"] == variant]
        if not picked:
            continue
        first = [r["commands"][0] for r in picked]
        tenth = [r["commands"][-1] for r in picked]
        v: dict[str, Any] = {"first_true_s": summary([c[0] for c in first]),
                             "first_true_tb": summary([float(c[1]) for c in first]),
                             "tenth_true_s": summary([c[0] for c in tenth]),
                             "tenth_true_tb": summary([float(c[1]) for c in tenth])}
        if variant == "warmed":
            v["warm_up_s"] = summary([r["warm_up_s"] for r in picked])
            v["warm_up_tb"] = summary([float(r["warm_up_tb"]) for r in picked])
            v["restore_warm_up_first_true_s"] = summary(
                [r["restore_s"] + r["warm_up_s"] + r["commands"][0][0] for r in picked])
        else:
            v["restore_first_true_s"] = summary([r["restore_s"] + r["commands"][0][0] for r in picked])
            extra = [(c1[0] - c10[0]) * 1000 / c1[1]
                     for c1, c10 in zip(first, tenth, strict=True) if c1[1] > 0]
            if extra:
                v["ms_per_new_tb"] = statistics.median(extra)
        out[variant] = v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--restores", type=int, default=8, help="restores (alternately cold and warmed)")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--kernel-arg", action="append", default=[], help="extra guest kernel argument")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capsa-profile-restore-", dir="/var/tmp"))
    work.chmod(0o755)
    data: dict[str, Any] = {"host": host_facts(), "args": vars(args) | {"out": str(args.out)}}
    try:
        data["profile"] = asyncio.run(profile(work, args.accel, max(2, args.restores), args.kernel_arg))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["end_load"] = list(os.getloadavg())
    write_results(args.out, data)

    s = data["profile"]["summary"]
    table = Table(title=f"restore on demand (accelerator {data['profile']['accelerator']}), p50")
    for column in ("step", "ms", "new TBs"):
        table.add_column(column)

    def ms(entry: dict[str, float] | None) -> str:
        return f"{entry['p50'] * 1000:.1f}" if entry else "-"

    def tbs(entry: dict[str, float] | None) -> str:
        return f"{entry['p50']:.0f}" if entry else ""

    table.add_row("QEMU start -> monitor", ms(s["qemu_to_qmp_s"]), "")
    table.add_row("monitor -> guest answers (load, cont, wake)", ms(s["qmp_to_ready_s"]), "")
    table.add_row("restore() whole (+ reseed, clock)", ms(s["restore_s"]), tbs(s["tb_at_restored"]))
    cold, warmed = s.get("cold", {}), s.get("warmed", {})
    table.add_row("cold: first true", ms(cold.get("first_true_s")), tbs(cold.get("first_true_tb")))
    table.add_row("cold: 10th true", ms(cold.get("tenth_true_s")), tbs(cold.get("tenth_true_tb")))
    table.add_row("cold: restore + first true", ms(cold.get("restore_first_true_s")), "")
    table.add_row("warmed: warm-up", ms(warmed.get("warm_up_s")), tbs(warmed.get("warm_up_tb")))
    table.add_row("warmed: first true", ms(warmed.get("first_true_s")), tbs(warmed.get("first_true_tb")))
    table.add_row("warmed: 10th true", ms(warmed.get("tenth_true_s")), tbs(warmed.get("tenth_true_tb")))
    table.add_row("warmed: restore + warm-up + first true",
                  ms(warmed.get("restore_warm_up_first_true_s")), "")
    Console().print(table)
    if "ms_per_new_tb" in cold:
        print(f"~{cold['ms_per_new_tb'] * 1000:.1f} us per newly translated block (cold first true)")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

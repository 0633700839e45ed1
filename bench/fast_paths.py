"""The fast paths in one run, as a user meets them (SDK -> `capsa serve` -> node -> QEMU), beside the guest
channel alone and gVisor runsc on the same host:

- a fresh `capsa serve` on an empty state dir (image and template caches warm): start to `/v1/ready`, and
  its first create (+ first `true`);
- create from the warm pool + first `true` (the bench waits for the refill between rounds), with the
  create and the first `true` apart, and the 10th `true` of the same session (each with the guest
  channel's time inside it, `duration_ms`);
- restore on demand (no pool) + first `true`;
- steady-state `true` through the API vs straight through the guest channel: on the same session at the
  same moment (each answer's ``duration_ms``: the node's `GuestClient.exec` of that very command, the
  guest channel's round trip as the channel figure below times it), and on VMs of the bench's own
  (`GuestClient.exec` on a VM booted by the same runtime, and on one restored from its snapshot, as
  sessions are), with `capsa serve` in its own process (``--serve process``, the default, as users run it) and
  in the bench's process (``inproc``: SDK and server on one event loop); the other way is measured too,
  on a session of its own;
- resume after pause, branch into 4;
- gVisor runsc (systrap) `run --detach` + `exec true` over capsa's guest rootfs (bench/peers).

Ratios: runsc / pool (goal >= 3), API / channel (goal <= 1.2; ``api_true_vs_same_session_channel`` compares
p50s of the same commands, so it does not move with how fast one VM or another happened to be).
Writes bench/results/fast_paths.json.

    .venv/bin/python bench/fast_paths.py [--n 20] [--no-peer] [--serve process|inproc]
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

from rich.console import Console
from rich.table import Table

from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.runtime.base import RamMode, VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool, StorageSettings
from capsa.sdk import AsyncSession
from harness import host_facts, pool_settled, summary, write_results
from peers.gvisor import measure_runsc
from peers.install import DEFAULT_DIR, Installer, PeerUnavailable
from session_ops import serving, serving_process

RESULTS = Path(__file__).with_name("results") / "fast_paths.json"
WARM = 10  # commands before "steady state"


async def _trues(run: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await run()
        out.append(time.perf_counter() - t)
    return out


async def _api_trues(session: AsyncSession, n: int) -> tuple[list[float], list[float]]:
    """``n`` `true` through the API: the SDK's time for each and the guest channel's time inside it (the
    answer's ``duration_ms``, measured by the node around the guest channel's exec)."""
    took, inside = [], []
    for _ in range(n):
        t = time.perf_counter()
        result = await session.commands.run("true")
        took.append(time.perf_counter() - t)
        inside.append(result.duration_ms / 1000)
    return took, inside


async def channel(state: Path, accel: str, n: int) -> dict[str, Any]:
    """`true` straight through the guest channel: on a booted VM (``true_s``) and on a VM restored from a
    snapshot of it on the node's kind of storage pool, RAM mapped shared as sessions' are by default
    (``restored_true_s``: the same kind of VM an API session runs in)."""
    pool = StoragePool.open(state / "pool", StorageSettings(loop_size_mib=8 * 1024))
    runtime = QemuRuntime(Settings(state_dir=state / "channel"), accel=accel, accel_cache=False,
                          storage=PoolStorage(pool))
    try:
        spec = VMSpec(image=ensure_image(Settings()))
        sandbox = await runtime.boot(spec)
        await _trues(lambda: sandbox.guest.exec("true"), WARM)
        out: dict[str, Any] = {"true_s": summary(await _trues(lambda: sandbox.guest.exec("true"), n)),
                               "accelerator": str(sandbox.accelerator)}
        snap = await runtime.snapshot(sandbox, resume=False)
        await runtime.destroy(sandbox)
        restored = await runtime.restore(snap, spec, ram_mode=RamMode.COPY)
        await _trues(lambda: restored.guest.exec("true"), WARM)
        out["restored_true_s"] = summary(await _trues(lambda: restored.guest.exec("true"), n))
        await runtime.destroy(restored)
        runtime.delete_snapshot(snap)
        return out
    finally:
        await runtime.close()
        pool.destroy()


async def _create(url: str, key: str) -> AsyncSession:
    return await AsyncSession.create(timeout=3600, api_url=url, api_key=key)


async def _create_and_use(url: str, key: str, made: list[AsyncSession], samples: dict[str, list[float]],
                          path: str) -> None:
    """One session: create, first `true`, nine more (the 10th kept), close; ``path``_* samples."""
    t = time.perf_counter()
    s = await _create(url, key)
    made.append(s)
    created = time.perf_counter()
    first = await s.commands.run("true")
    done = time.perf_counter()
    samples.setdefault(f"{path}_create_s", []).append(created - t)
    samples.setdefault(f"{path}_first_true_s", []).append(done - created)
    samples.setdefault(f"{path}_create_first_true_s", []).append(done - t)
    samples.setdefault(f"{path}_first_true_channel_s", []).append(first.duration_ms / 1000)
    took, inside = await _api_trues(s, 9)
    samples.setdefault(f"{path}_tenth_true_s", []).append(took[-1])
    samples.setdefault(f"{path}_tenth_true_channel_s", []).append(inside[-1])
    await s.close()
    made.remove(s)


SERVERS = {"process": serving_process, "inproc": serving}
"""How the bench runs ``capsa serve``: its own process (as users run it) or in the bench's process (the
SDK and the server then share one event loop and one core at a time)."""


async def fresh_and_pool(state: Path, accel: str, n: int, server: str) -> dict[str, Any]:
    """A fresh serve with the default warm pool: readiness, first create, pool creates, steady API
    `true`, resume and branch."""
    out: dict[str, Any] = {}
    samples: dict[str, list[float]] = {}
    started = time.perf_counter()
    async with SERVERS[server](state, accel, {"base": 1}) as (url, key, made):
        out["start_to_ready_s"] = time.perf_counter() - started
        t = time.perf_counter()
        first = await _create(url, key)
        made.append(first)
        out["first_create_s"] = time.perf_counter() - t
        await first.commands.run("true")
        out["first_create_first_true_s"] = time.perf_counter() - t
        out["start_to_first_true_s"] = time.perf_counter() - started
        await first.close()
        made.remove(first)
        for _ in range(n):
            await pool_settled(state, live=0, quiet_s=2.0, quiet_cpu_s=0.2)
            await _create_and_use(url, key, made, samples, "pool")
        await pool_settled(state, live=0, quiet_s=2.0, quiet_cpu_s=0.2)
        s = await _create(url, key)
        made.append(s)
        await pool_settled(state, live=1, quiet_s=2.0, quiet_cpu_s=0.2)  # no refill running beside it
        await _trues(lambda: s.commands.run("true"), WARM)
        samples["api_true_s"], samples["api_true_channel_s"] = await _api_trues(s, n)
        for _ in range(max(3, n // 4)):
            await s.pause()
            t = time.perf_counter()
            await s.resume()
            samples.setdefault("resume_s", []).append(time.perf_counter() - t)
            t = time.perf_counter()
            kids = await s.branch(4)
            samples.setdefault("branch_4_s", []).append(time.perf_counter() - t)
            for kid in kids:
                await kid.close()
    out.update({name: summary(values) for name, values in samples.items()})
    return out


async def api_steady(state: Path, accel: str, n: int, server: str) -> dict[str, Any]:
    """Steady-state `true` through the API alone (no pool: one restore on demand)."""
    async with SERVERS[server](state, accel, {}) as (url, key, made):
        s = await _create(url, key)
        made.append(s)
        await _trues(lambda: s.commands.run("true"), WARM)
        took, inside = await _api_trues(s, n)
        return {"api_true_s": summary(took), "api_true_channel_s": summary(inside)}


async def restore_on_demand(state: Path, accel: str, n: int, server: str) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    async with SERVERS[server](state, accel, {}) as (url, key, made):
        made.append(await _create(url, key))  # the node's first restore: not counted
        for _ in range(n):
            await _create_and_use(url, key, made, samples, "restore")
    return {name: summary(values) for name, values in samples.items()}


def runsc(n: int, peers_dir: Path) -> dict[str, Any]:
    installer = Installer(peers_dir)
    image = ensure_image(Settings())
    got = measure_runsc(installer.runsc("trixie"), "systrap", installer.rootfs(image), n)
    return {"version": got["version"], "create_first_exec_s": summary(got["create_first_exec"])}


def _ms(entry: dict[str, Any] | None) -> str:
    return "-" if not entry else f"{entry['p50'] * 1000:.1f} (p95 {entry['p95'] * 1000:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20, help="samples per figure")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--no-peer", action="store_true", help="skip gVisor runsc")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--serve", choices=sorted(SERVERS), default="process",
                        help="capsa serve in its own process (default) or in the bench's; steady `true` "
                             "through the API is measured the other way too")
    args = parser.parse_args()
    other = "inproc" if args.serve == "process" else "process"
    facts = host_facts()
    work = Path(tempfile.mkdtemp(prefix="capsa-fast-", dir="/var/tmp"))
    work.chmod(0o755)
    data: dict[str, Any] = {"host": facts, "args": vars(args) | {"out": str(args.out),
                                                               "peers_dir": str(args.peers_dir)}}
    try:
        data["channel"] = asyncio.run(channel(work, args.accel, args.n))
        data["serve"] = asyncio.run(fresh_and_pool(work / "a", args.accel, args.n, args.serve))
        data["serve"].update(asyncio.run(restore_on_demand(work / "b", args.accel, args.n, args.serve)))
        data[f"serve_{other}"] = asyncio.run(api_steady(work / "c", args.accel, args.n, other))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.no_peer:
        try:
            data["runsc"] = runsc(args.n, args.peers_dir)
        except (PeerUnavailable, OSError) as exc:
            data["runsc"] = {"skipped": str(exc)}
    serve, chan = data["serve"], data["channel"]
    steady = data[f"serve_{other}"]
    ratios = {"api_true_vs_same_session_channel": (serve["api_true_s"]["p50"]
                                                   / serve["api_true_channel_s"]["p50"]),
              f"api_true_{other}_vs_same_session_channel": (steady["api_true_s"]["p50"]
                                                            / steady["api_true_channel_s"]["p50"]),
              "api_true_vs_channel": serve["api_true_s"]["p50"] / chan["true_s"]["p50"],
              "api_true_vs_restored_channel": serve["api_true_s"]["p50"] / chan["restored_true_s"]["p50"],
              f"api_true_{other}_vs_channel": steady["api_true_s"]["p50"] / chan["true_s"]["p50"]}
    if "create_first_exec_s" in data.get("runsc", {}):
        ratios["runsc_vs_pool_create_first_true"] = (data["runsc"]["create_first_exec_s"]["p50"]
                                                     / serve["pool_create_first_true_s"]["p50"])
    data["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    data["end_load"] = list(os.getloadavg())
    write_results(args.out, data)

    table = Table(title=f"fast paths (accelerator {chan['accelerator']}), ms p50")
    table.add_column("figure")
    table.add_column("ms")
    table.add_column("goal")
    def once(value: float) -> dict[str, float]:
        return {"p50": value, "p95": value}

    rows = [
        ("fresh serve: start -> ready", once(serve["start_to_ready_s"]), ""),
        ("fresh serve: first create", once(serve["first_create_s"]), "<= 1000"),
        ("pool create", serve.get("pool_create_s"), ""),
        ("pool: first true", serve.get("pool_first_true_s"), ""),
        ("pool create + first true", serve.get("pool_create_first_true_s"), "<= 60"),
        ("pool: 10th true", serve.get("pool_tenth_true_s"), ""),
        ("  pool: first / 10th true's guest channel", serve.get("pool_first_true_channel_s"), ""),
        ("", serve.get("pool_tenth_true_channel_s"), ""),
        ("restore on demand + first true", serve.get("restore_create_first_true_s"), "<= 400"),
        ("restore: first / 10th true", serve.get("restore_first_true_s"), ""),
        ("", serve.get("restore_tenth_true_s"), ""),
        ("  restore: first / 10th true's guest channel", serve.get("restore_first_true_channel_s"), ""),
        ("", serve.get("restore_tenth_true_channel_s"), ""),
        ("true, guest channel (booted VM)", chan["true_s"], "<= 40"),
        ("true, guest channel (restored VM)", chan["restored_true_s"], "<= 40"),
        (f"true, API (serve {args.serve})", serve.get("api_true_s"), "<= 1.2x channel"),
        ("  its guest channel (duration_ms)", serve.get("api_true_channel_s"), ""),
        (f"true, API (serve {other})", data[f"serve_{other}"].get("api_true_s"), ""),
        ("  its guest channel (duration_ms)", data[f"serve_{other}"].get("api_true_channel_s"), ""),
        ("resume", serve.get("resume_s"), "<= 400"),
        ("branch into 4", serve.get("branch_4_s"), "<= 1000"),
        ("gVisor runsc create + first exec", data.get("runsc", {}).get("create_first_exec_s"), ""),
    ]
    for name, entry, goal in rows:
        table.add_row(name, _ms(entry), goal)
    console = Console()
    console.print(table)
    console.print(f"ratios: {data['ratios']}")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

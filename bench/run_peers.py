"""Peers benchmark: create + first exec of ``true`` in capsa vs gVisor runsc, nitrobox and llm-sandbox.

One figure for every sandbox: the time from asking for a new sandbox until its first command (``true``)
has returned, p50/p95 over ``n`` runs, with ratios against capsa's warm pool measured in the same run.

* capsa: the node agent's real creation paths, driven by ``bench/create_paths.py``'s own functions:
  warm pool, restore on demand (pool off) and cold boot (fewer samples: 5-10 s each under TCG).
* gVisor runsc, bookworm's 20221219 (ptrace) and trixie's 20240729 (systrap), over capsa's guest rootfs
  with ``--network=none`` (:mod:`peers.gvisor`).
* nitrobox 0.1.0 (namespace sandbox; python3.13 from trixie, see :mod:`peers.install`).
* llm-sandbox: its daemonless bubblewrap backend; the Docker backend is skipped (no Docker daemon).

Peers are installed under ``--peers-dir`` (never into the project's virtualenv); one that cannot be
installed or run is skipped with its reason printed and stored. Run as root from the repository root::

    .venv/bin/python bench/run_peers.py [--n 20] [--cold 3] [--out bench/results/peers.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
from capsa.node.storage import StoragePool, StorageSettings
from capsa.node.templates.source import TemplateSource
from create_paths import _cold, _creates
from harness import host_facts, summary, write_results
from peers.gvisor import measure_runsc
from peers.install import DEFAULT_DIR, Installer, PeerUnavailable

__all__ = ["main"]

BASELINE = "capsa_warm_pool"
HERE = Path(__file__).resolve().parent


def _entry(samples: list[float], kind: str, isolation: str, **extra: Any) -> dict[str, Any]:
    return {"create_first_exec_s": summary(samples), "kind": kind, "isolation": isolation, **extra}


async def _capsa(args: argparse.Namespace, image: GuestImage) -> dict[str, dict[str, Any]]:
    """The same node setup as bench/create_paths.py (btrfs loop pool in a temporary state dir)."""
    settings = Settings()
    state = Path(tempfile.mkdtemp(prefix="capsa-bench-peers-", dir="/var/tmp"))
    os.chmod(state, 0o711)
    pool = StoragePool.open(state, StorageSettings(loop_size_mib=16384, require_cow=True))
    runtime = QemuRuntime(Settings(state_dir=state, cache_dir=settings.cache_dir, accel=args.accel),
                              storage=PoolStorage(pool))
    source = TemplateSource(runtime, image, pool_size=1)
    agent = NodeAgent(runtime, image, source=source,
                      capacity=NodeCapacity(memory_mib=20480, vcpus=64, max_sandboxes=64))
    vm = "QEMU microvm, own kernel (TCG here: no hardware virtualization)"
    out: dict[str, dict[str, Any]] = {}
    try:
        await agent.start()
        await agent.wait_ready()
        _, first, sources = await _creates(agent, args.n, pooled=True)
        out["capsa_warm_pool"] = _entry(first, "microVM", vm,
                                        sources={s: sources.count(s) for s in set(sources)})
        print("capsa warm pool done", flush=True)
        await source.warm.drain()
        source.warm.default_size = 0
        _, first, sources = await _creates(agent, args.n, pooled=False)
        out["capsa_restore_on_demand"] = _entry(first, "microVM", vm,
                                                sources={s: sources.count(s) for s in set(sources)})
        print("capsa restore on demand done", flush=True)
        if args.cold > 0:
            _, first = await _cold(runtime, VMSpec(image=image, memory_mib=256), args.cold)
            out["capsa_cold_boot"] = _entry(first, "microVM", vm,
                                            note=f"n={args.cold}: each cold boot takes seconds under TCG")
            print("capsa cold boot done", flush=True)
    finally:
        await agent.close()
        pool.destroy()
        shutil.rmtree(state, ignore_errors=True)
    return out


def _driver(python: Path, script: str, argv: list[str], env: dict[str, str] | None = None,
            timeout: float = 900) -> dict[str, Any]:
    proc = subprocess.run([str(python), str(HERE / "peers" / script), *argv], capture_output=True,
                          text=True, timeout=timeout, check=False, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise PeerUnavailable(f"{script} exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _peers(args: argparse.Namespace, image: GuestImage) -> dict[str, dict[str, Any]]:
    inst = Installer(Path(args.peers_dir))
    out: dict[str, dict[str, Any]] = {}

    def attempt(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            out[name] = fn()
            print(f"{name} done", flush=True)
        except (PeerUnavailable, subprocess.TimeoutExpired, OSError) as exc:
            out[name] = {"skipped": str(exc)}
            print(f"[skip] {name}: {exc}", flush=True)

    def runsc(suite: str, platform: str) -> dict[str, Any]:
        got = measure_runsc(inst.runsc(suite), platform, inst.rootfs(image), args.n)
        return _entry(got["create_first_exec"], f"gVisor {platform}",
                      f"gVisor user-space kernel ({platform} platform)",
                      version=got["version"], run_true_oneshot_s=summary(got["run_true_oneshot"]),
                      note="runsc run --detach (sleep infinity) + runsc exec true, --network=none, "
                           "capsa's guest rootfs read-only; run_true_oneshot_s: `runsc run` of true "
                           "including teardown")

    def nitrobox() -> dict[str, Any]:
        py = inst.nitrobox()
        rootfs = inst.rootfs(image)
        work = Path(tempfile.mkdtemp(prefix="capsa-bench-nitrobox-", dir="/var/tmp"))
        try:
            got = _driver(py, "nitrobox_driver.py", [str(rootfs), str(args.n), str(work)])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return _entry(got["create_first_exec"], "namespaces",
                      "Linux namespaces + overlayfs + seccomp (shared host kernel)",
                      first_create_s=got["first_create_s"],
                      note="nitrobox 0.1.0 on trixie's python3.13, rootful, net_isolate=True, capsa's guest "
                           "rootfs as the image; its image config pre-seeded (else each create waits ~37 s "
                           "on registry lookups that cannot succeed offline)")

    def llm_sandbox() -> dict[str, Any]:
        py = inst.llm_sandbox()
        env = dict(os.environ, PATH=f"{inst.bwrap().parent}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        got = _driver(py, "llm_sandbox_driver.py", [str(args.n), str(args.n_slow)], env=env)
        out["llm_sandbox_docker"] = {"skipped": got["docker_backend"]}
        return _entry(got["create_first_exec"], "bubblewrap",
                      "bubblewrap namespaces over the host's own directories (shared host kernel)",
                      create_first_exec_python_env_s=summary(got["create_first_exec_python_env"]),
                      note="llm-sandbox backend='bubblewrap', skip_environment_setup=True; "
                           "create_first_exec_python_env_s: the lang='python' default, which builds a "
                           f"virtualenv per session (n={args.n_slow})")

    attempt("gvisor_runsc_20240729_systrap", lambda: runsc("trixie", "systrap"))
    attempt("gvisor_runsc_20221219_ptrace", lambda: runsc("bookworm", "ptrace"))
    attempt("nitrobox", nitrobox)
    attempt("llm_sandbox_bubblewrap", llm_sandbox)
    return out


def _table(entries: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]]) -> Table:
    table = Table(title="create + first exec of `true` (ratio: / capsa warm pool, same run)")
    for col in ("sandbox", "kind", "n", "p50 ms", "p95 ms", "p50 ratio", "p95 ratio"):
        table.add_column(col, justify="left" if col in ("sandbox", "kind") else "right")
    for name, e in entries.items():
        if "skipped" in e:
            table.add_row(name, f"skipped: {e['skipped']}", "-", "-", "-", "-", "-")
            continue
        s, r = e["create_first_exec_s"], ratios[name]
        table.add_row(name, e["kind"], str(s["n"]), f"{s['p50'] * 1000:.1f}", f"{s['p95'] * 1000:.1f}",
                      f"{r['p50']:.2f}", f"{r['p95']:.2f}")
    return table


async def main(args: argparse.Namespace) -> dict[str, Any]:
    image = ensure_image(Settings())
    results: dict[str, Any] = {
        "host": host_facts(),
        "figure": "seconds from asking for a new sandbox until its first `true` returned "
                  "(sandbox deletion outside the timing)",
        "n": {"fast_paths": args.n, "capsa_cold_boot": args.cold, "llm_sandbox_python_env": args.n_slow},
    }
    entries: dict[str, dict[str, Any]] = {}
    entries.update(await _capsa(args, image))
    entries.update(await asyncio.to_thread(_peers, args, image))
    base = entries[BASELINE]["create_first_exec_s"]
    ratios = {name: {"p50": e["create_first_exec_s"]["p50"] / base["p50"],
                     "p95": e["create_first_exec_s"]["p95"] / base["p95"]}
              for name, e in entries.items() if "skipped" not in e}
    results["entries"] = entries
    results["ratios_vs_capsa_warm_pool"] = ratios
    results["skipped"] = {name: e["skipped"] for name, e in entries.items() if "skipped" in e}
    results["load_end"] = list(os.getloadavg())
    results["time_end"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # Wide enough for the sandbox names when stdout is a file or pipe (rich assumes 80 columns).
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    console.print(_table(entries, ratios))
    for name, e in entries.items():
        if "skipped" in e:
            print(f"skipped {name}: {e['skipped']}")
    write_results(Path(args.out), results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20,
                        help="samples for the fast paths (capsa pool/restore, peers)")
    parser.add_argument("--cold", type=int, default=3, help="capsa cold boots (5-10 s each under TCG)")
    parser.add_argument("--n-slow", type=int, default=5, help="llm-sandbox sessions with a Python virtualenv")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--peers-dir", default=str(DEFAULT_DIR))
    parser.add_argument("--out", default="bench/results/peers.json")
    asyncio.run(main(parser.parse_args()))

"""Session operations end to end through the public API: create, snapshot, pause, resume, restore, branch.

Runs the real product path in one process: ``capsa.serve.run`` (control plane + local node with the
snapshot runtime, embedded SQLite) on loopback, driven by the SDK. Every figure is a full API call as a
user sees it (SDK -> HTTP -> control plane -> node API -> QEMU). The warm pool is off by default
(``--pool-size``) so a background refill does not run during the measurements; creation is then a restore
on demand. Writes ``bench/results/session_ops.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from capsa import serve
from capsa.control.keys import generate_key
from capsa.sdk import AsyncSession
from capsa.sdk.errors import CapsaAPIError
from harness import host_facts, summary, write_results

RESULTS = Path(__file__).with_name("results") / "session_ops.json"
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _time(samples: dict[str, list[float]], name: str, call: Awaitable[T]) -> T:
    # ``call`` is a coroutine not started yet: creating it costs nothing, running it is what is timed.
    start = time.perf_counter()
    result = await call
    samples.setdefault(name, []).append(time.perf_counter() - start)
    return result


async def _wait_ready(url: str, server: asyncio.Task[Any]) -> None:
    async with httpx.AsyncClient() as probe:
        for _ in range(1500):
            if server.done():
                raise RuntimeError(f"capsa serve stopped before it was ready: {server.result()!r}")
            with contextlib.suppress(httpx.HTTPError):
                if (await probe.get(f"{url}/v1/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError("capsa serve did not become ready")


async def _close_all(made: list[AsyncSession]) -> None:
    for s in made:
        with contextlib.suppress(CapsaAPIError):
            await s.close()


@contextlib.asynccontextmanager
async def serving(state: Path, accel: str, pool_sizes: dict[str, int] | None = None
                  ) -> AsyncIterator[tuple[str, str, list[AsyncSession]]]:
    """``capsa serve`` in this process on ``state``: (its URL, an admin key, a list whose sessions are
    closed at the end). ``pool_sizes``: the only warm pools (every other template 0); None keeps the
    environment's (``CAPSA_POOL_SIZE``/``CAPSA_POOL_SIZES``) settings."""
    key = generate_key().full
    os.environ["CAPSA_BOOTSTRAP_KEY"] = key
    if pool_sizes is not None:
        os.environ["CAPSA_POOL_SIZE"] = "0"
        os.environ["CAPSA_POOL_SIZES"] = json.dumps(pool_sizes)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve.run("127.0.0.1", port, state / "serve", None, accel))
    made: list[AsyncSession] = []
    try:
        await _wait_ready(url, server)
        yield url, key, made
    finally:
        await _close_all(made)
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


@contextlib.asynccontextmanager
async def serving_process(state: Path, accel: str, pool_sizes: dict[str, int] | None = None
                          ) -> AsyncIterator[tuple[str, str, list[AsyncSession]]]:
    """:func:`serving` with ``capsa serve`` as its own process (as users run it: the SDK's work and the
    server's then run on separate cores, and the server's work after an answer, such as the audit commit,
    does not wait on the SDK's event loop). Stopped with SIGTERM, as systemd would."""
    key = generate_key().full
    env = {**os.environ, "CAPSA_BOOTSTRAP_KEY": key}
    if pool_sizes is not None:
        env["CAPSA_POOL_SIZE"] = "0"
        env["CAPSA_POOL_SIZES"] = json.dumps(pool_sizes)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    capsa = Path(sys.executable).with_name("capsa")
    proc = await asyncio.create_subprocess_exec(
        str(capsa), "serve", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state / "serve"),
        "--accel", accel, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    exited = asyncio.create_task(proc.wait())
    made: list[AsyncSession] = []
    try:
        await _wait_ready(url, exited)
        yield url, key, made
    finally:
        await _close_all(made)
        if proc.returncode is None:
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exited), 120)
        if proc.returncode is None:
            proc.kill()
            await exited


async def measure(state: Path, accel: str, rounds: int, memory_mib: int) -> dict[str, list[float]]:
    key = generate_key().full
    os.environ["CAPSA_BOOTSTRAP_KEY"] = key
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve.run("127.0.0.1", port, state / "serve", None, accel))
    samples: dict[str, list[float]] = {}
    try:
        await _wait_ready(url, server)
        # The first creation builds the base template (one cold boot): not part of the figures.
        warm = await AsyncSession.create(timeout=3600, memory_mib=memory_mib, api_url=url, api_key=key)
        await warm.close()
        for _ in range(rounds):
            s = await _time(samples, "create_s", AsyncSession.create(
                timeout=3600, memory_mib=memory_mib, api_url=url, api_key=key))
            try:
                await s.files.write("/root/state", "x" * 4096)
                snap = await _time(samples, "snapshot_s", s.snapshots.create())
                await _time(samples, "pause_s", s.pause())
                await _time(samples, "resume_s", s.resume())
                await _time(samples, "first_exec_after_resume_s", s.commands.run("true"))
                await _time(samples, "restore_s", s.snapshots.restore(snap.id))
                for n in (1, 4):
                    kids = await _time(samples, f"branch_{n}_s", s.branch(n))
                    for kid in kids:
                        await kid.close()
            finally:
                await _time(samples, "close_s", s.close())
        return samples
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--pool-size", type=int, default=0)
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["CAPSA_POOL_SIZE"] = str(args.pool_size)
    state = Path(tempfile.mkdtemp(prefix="csbench-", dir="/var/tmp"))
    os.chmod(state, 0o711)  # QEMU runs as another uid
    try:
        load_start = os.getloadavg()
        samples = await measure(state, args.accel, args.rounds, args.memory)
        figures = {name: summary(values) for name, values in samples.items()}
        data: dict[str, Any] = {
            "host": host_facts(), "load_start": load_start, "load_end": os.getloadavg(),
            "rounds": args.rounds, "memory_mib": args.memory, "pool_size": args.pool_size,
            "accel": args.accel, "seconds": figures,
            "ratios_p50": {
                "resume_vs_create": round(figures["resume_s"]["p50"] / figures["create_s"]["p50"], 3),
                "branch_4_vs_branch_1": round(figures["branch_4_s"]["p50"] / figures["branch_1_s"]["p50"], 3),
            },
        }
        write_results(args.out, data)
        print(f"{'operation (through the API)':32} {'p50 s':>8} {'p95 s':>8} {'n':>4}")
        for name, fig in figures.items():
            print(f"{name:32} {fig['p50']:8.3f} {fig['p95']:8.3f} {fig['n']:4d}")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())

"""API overhead: ``commands.run("true")`` through SDK -> control plane -> node agent -> guest, against the
same command straight through the runtime's guest channel; and sessions created per second.

Runs the real product path in one process: ``capsa.serve.run`` (control plane + local node, embedded
SQLite, real QEMU microVMs) and the public SDK. The baseline boots one VM with the same runtime and calls
``GuestClient.exec`` directly. Writes bench/results/api.json and prints a table.

    .venv/bin/python bench/api_overhead.py [--execs 200] [--sessions 5] [--accel tcg]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from capsa import serve
from capsa.common.settings import Settings
from capsa.control.keys import generate_key
from capsa.images import ensure_image
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime
from capsa.sdk import AsyncSession
from harness import host_facts, summary, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "api.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _timed(n: int, call: Any) -> list[float]:
    await call()  # warm-up
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def direct(state: Path, accel: str, execs: int) -> dict[str, Any]:
    runtime = QemuRuntime(Settings(state_dir=state / "direct"), accel=accel, accel_cache=False)
    try:
        sandbox = await runtime.boot(VMSpec(image=ensure_image(Settings())))
        times = await _timed(execs, lambda: sandbox.guest.exec("true"))
        return {"exec_true_ms": summary(times), "accelerator": str(sandbox.accelerator)}
    finally:
        await runtime.close()


async def through_api(state: Path, accel: str, execs: int, sessions: int) -> dict[str, Any]:
    key = generate_key().full
    os.environ["CAPSA_BOOTSTRAP_KEY"] = key
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve.run("127.0.0.1", port, state / "serve", None, accel))
    try:
        async with httpx.AsyncClient() as probe:
            for _ in range(600):
                if server.done():
                    server.result()
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"{url}/v1/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
        session = await AsyncSession.create(timeout=3600, api_url=url, api_key=key)
        try:
            times = await _timed(execs, lambda: session.commands.run("true"))
        finally:
            await session.close()
        create_s = []
        for _ in range(sessions):
            t = time.perf_counter()
            s = await AsyncSession.create(timeout=600, api_url=url, api_key=key)
            create_s.append(time.perf_counter() - t)
            await s.close()
        return {
            "exec_true_ms": summary(times),
            "session_create_s": summary(create_s),
            "sessions_per_second": round(len(create_s) / sum(create_s), 4),
        }
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="cbench-", dir="/tmp"))
    os.chmod(state, 0o711)  # QEMU runs as another uid
    try:
        load_start = os.getloadavg()
        base = await direct(state, args.accel, args.execs)
        api = await through_api(state, args.accel, args.execs, args.sessions)
        ratio = api["exec_true_ms"]["p50"] / base["exec_true_ms"]["p50"]
        data = {
            "host": host_facts(),
            "load_start": load_start,
            "load_end": os.getloadavg(),
            "direct_channel": base,
            "through_api": api,
            "api_overhead_ratio_p50": round(ratio, 3),
            "note": "sessions are cold-booted (no snapshots/warm pool yet); creation time is a cold boot",
        }
        write_results(args.out, data)
        print(f"accelerator                 {base['accelerator']}")
        for name, part in (("direct ", base), ("via API", api)):
            ms = part["exec_true_ms"]
            print(f"exec true {name} p50/p95   {ms['p50']:.2f} / {ms['p95']:.2f} ms")
        print(f"API overhead ratio (p50)    {ratio:.2f}x")
        print(f"session create p50          {api['session_create_s']['p50']:.2f} s")
        print(f"sessions per second         {api['sessions_per_second']:.3f}")
        print(f"wrote {args.out}")
    finally:
        import shutil

        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())

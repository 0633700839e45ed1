"""The control plane's own cost per command: ``POST /v1/sessions/{id}/commands`` (``true``) over HTTP with
the guest replaced by the fake runtime (a guest daemon running on the host, tests/support), so the figures
are the API + database + node-API hops, not a VM. Counts the database writes per command and times the
round trip for two configurations in the same run:

* ``every_call``: ``rate_lease=1`` and ``activity_stamp_interval=0`` (a counter write and an activity write
  on every command, as before the leases; the old code also ran a third, conditional UPDATE from
  ``command_finished`` on every command, which no setting brings back);
* ``defaults``: rate-limit leases of 16 and activity stamps at most every 5 s.

    .venv/bin/python bench/control_hot_path.py [--n 300] [--out bench/results/control_hot_path.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: the fake runtime

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

from harness import host_facts, summary, write_results

__all__ = ["main"]

CONFIGS: dict[str, dict[str, Any]] = {
    "every_call": {"rate_lease": 1, "activity_stamp_interval": 0},
    "defaults": {},
}


async def run_config(name: str, overrides: dict[str, Any], n: int, tmp: Path) -> dict[str, Any]:
    settings = {"command_limit": 100_000, "reaper_interval": 0, "rolling_snapshot_interval": 0, **overrides}
    stack = ApiStack(f"sqlite+aiosqlite:///{tmp}/{name}.db", FakeRuntime(), fake_image(tmp / "image"),
                     settings=settings)
    await stack.start()
    try:
        key = await stack.tenant_key("bench")
        engine = stack.replicas[0].app.state.plane.engine.sync_engine
        writes: list[str] = []

        def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            words = statement.split()
            if words[0].upper() in ("UPDATE", "DELETE"):
                writes.append(f"{words[0]} {words[1] if words[0].upper() == 'UPDATE' else words[2]}")
            elif words[0].upper() == "INSERT":
                writes.append(f"INSERT {words[2]}")

        async with stack.client(key) as c:
            sid = (await c.post("/v1/sessions", json={})).json()["id"]
            for _ in range(10):  # warm-up: connections, the guest's first spawns
                await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
            event.listen(engine, "before_cursor_execute", on_execute)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                response = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
                times.append(time.perf_counter() - t0)
                assert response.status_code == 200, response.text
            event.remove(engine, "before_cursor_execute", on_execute)
            await c.delete(f"/v1/sessions/{sid}")
        return {"settings": overrides, "round_trip_ms": {k: v * 1000 if k != "n" else v
                                                         for k, v in summary(times).items()},
                "write_statements_per_command": len(writes) / n,
                "write_statements": {t: writes.count(t) for t in set(writes)}}
    finally:
        await stack.stop()


async def bench(n: int) -> dict[str, Any]:
    results: dict[str, Any] = {"host": host_facts(), "n": n}
    with tempfile.TemporaryDirectory(prefix="capsa-hotpath-") as tmp:
        for name, overrides in CONFIGS.items():
            results[name] = await run_config(name, overrides, n, Path(tmp))
    results["host"]["loadavg_at_end"] = list(os.getloadavg())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "control_hot_path.json")
    args = parser.parse_args()
    results = asyncio.run(bench(args.n))
    write_results(args.out, results)
    for name in CONFIGS:
        r = results[name]
        rt = r["round_trip_ms"]
        print(f"{name:11s} true through the API: p50 {rt['p50']:.2f} ms p95 {rt['p95']:.2f} ms; "
              f"database writes per command {r['write_statements_per_command']:.3f} {r['write_statements']}")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

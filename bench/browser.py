"""Browser sessions: the ``browser`` (or, ``--template desktop``, the ``desktop``) template's cost and
latencies through ``capsa serve`` (control plane + local node in this process, embedded SQLite), driven by
the SDK.

1. the first ``browser`` session (builds the template, or imports it from the template cache: ``origin``);
2. ``--sessions`` more sessions, each timed from create to its first screenshot: a cold restore of the
   template and the first CDP round trip (``restore_to_first_screenshot_s``), then as many from the warm
   pool (``pool_to_first_screenshot_s``; before each, the bench waits for the pool's VM to be restored and
   idle);
3. per action latency on one session: screenshot, left_click, type of 100 characters, key;
4. PSS of each idle browser sandbox's QEMU process after ``--idle`` seconds.

The policy allows one domain that does not resolve: no traffic leaves. Writes
``bench/results/<template>.json``. On ``desktop`` the actions are xdotool and scrot commands on the X
screen (one guest command each) instead of CDP calls.
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

from capsa.sdk import AsyncSession
from harness import host_facts, memory_kib, pool_settled, qemu_pids, summary, write_results
from session_ops import serving

RESULTS = Path(__file__).with_name("results")
TEMPLATES = ("browser", "desktop")
POLICY = {"domains": [{"domain": "bench.invalid"}]}


async def _create(template: str, url: str, key: str) -> AsyncSession:
    return await AsyncSession.create(template, memory_mib=1024, timeout=7200, policy=POLICY,
                                     metadata={"screen": "1280x800"}, api_url=url, api_key=key)


async def _timed(n: int, action: Any) -> dict[str, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await action()
        times.append(time.perf_counter() - t0)
    return summary(times)


async def _to_first_screenshot(template: str, url: str, key: str, made: list[AsyncSession]) -> float:
    t0 = time.perf_counter()
    s = await _create(template, url, key)
    made.append(s)
    await s.computer.screenshot()
    return time.perf_counter() - t0


async def measure_pool(template: str, state: Path, accel: str, sessions: int) -> dict[str, Any]:
    """A second ``capsa serve`` (fresh state dir, template from the cache) with a warm pool of one
    ``template`` VM (and no other pool, so its VM is the one QEMU more than the sessions): each session
    is bound from the pool, the bench waiting for the refill in between."""
    async with serving(state, accel, {template: 1}) as (url, key, made):
        made.append(await _create(template, url, key))  # imports the template; the pool then fills
        pooled: list[float] = []
        for _ in range(sessions):
            await pool_settled(state, live=len(made))
            pooled.append(await _to_first_screenshot(template, url, key, made))
        return {"pool_to_first_screenshot_s": summary(pooled)}


async def measure(template: str, state: Path, accel: str, sessions: int, actions: int,
                  idle_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with serving(state, accel, {}) as (url, key, made):  # every session a cold restore
        out["first_session_to_screenshot_s"] = round(await _to_first_screenshot(template, url, key, made), 2)
        restore = [await _to_first_screenshot(template, url, key, made) for _ in range(sessions)]
        out["restore_to_first_screenshot_s"] = summary(restore)
        c = made[0].computer
        out["screenshot_s"] = await _timed(actions, c.screenshot)
        out["left_click_s"] = await _timed(actions, lambda: c.click(640, 400))
        out["type_100_chars_s"] = await _timed(actions, lambda: c.type("x" * 100))
        out["key_s"] = await _timed(actions, lambda: c.key("ctrl+a"))
        await asyncio.sleep(idle_s)
        pss = [memory_kib(p).get("pss", 0) / 1024 for p in qemu_pids(state)]
        out["idle_pss_mib_per_sandbox"] = summary(pss) if pss else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", choices=TEMPLATES, default="browser")
    parser.add_argument("--sessions", type=int, default=3, help="more sessions to restore (default 3)")
    parser.add_argument("--actions", type=int, default=10, help="repetitions per action")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds idle before reading PSS")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--out", type=Path, help="default: bench/results/<template>.json")
    args = parser.parse_args()
    args.out = args.out or RESULTS / f"{args.template}.json"
    state = Path(tempfile.mkdtemp(prefix=f"capsa-{args.template}-", dir="/var/tmp"))
    state.chmod(0o755)
    try:
        facts = host_facts()
        result = asyncio.run(measure(args.template, state, args.accel, args.sessions, args.actions,
                                     args.idle))
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(mode=0o755)
        result |= asyncio.run(measure_pool(args.template, state, args.accel, args.sessions))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    data = {"host": facts, "end_load": os.getloadavg(), "args": vars(args) | {"out": str(args.out)},
            **result}
    write_results(args.out, data)
    for name, value in result.items():
        print(f"{name:34} {value}")


if __name__ == "__main__":
    main()

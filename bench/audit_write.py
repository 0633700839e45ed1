"""Audit write cost: how many chain events per second the store sustains on SQLite and PostgreSQL, and what
recording adds to each command through the API.

* ``store``: ``capsa.control.audit.trail.write`` straight against a migrated database, per backend:
  one event per transaction from one writer (the shape of an API call's flush), the same from 8
  concurrent writers on 2 engines (replicas), and pages of 1000 events per transaction (the shape of an
  egress collection from a node: one transaction per page). PostgreSQL is a throwaway 15 cluster
  (tests/support/postgres.py, ``fsync=off`` as in the test suite, so it measures the database's work,
  not the disk); SQLite is a file in a temporary directory with the control plane's own settings (WAL,
  default ``synchronous``).
* ``per_command``: ``POST /v1/sessions/{id}/commands`` (``true``) over HTTP with the fake runtime (no VM),
  SQLite, with the chain recorded (an ``api`` + a ``command`` event in one transaction per call) and with
  the middleware's write replaced by a no-op in the same run, rounds interleaved; sequential round trips,
  then commands/s from 8 concurrent clients (where group commit shares transactions).

    .venv/bin/python bench/audit_write.py [--events 2000] [--commands 300] [--no-postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: fake runtime, postgres

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.postgres import postgres_missing_reason, temporary_postgres

from capsa.control.audit import middleware as audit_middleware
from capsa.control.audit import trail as audit_trail
from capsa.control.audit.trail import AuditEntry
from capsa.control.store.db import create_engine, migrate, session_factory
from harness import host_facts, summary, write_results

__all__ = ["main"]

_DETAIL = {"argv": ["python3", "-c", "print(1)"], "cwd": "/work", "user": None, "exit_code": 0,
           "duration_ms": 12.5, "env_keys": ["A", "B"]}


async def store_bench(url: str, events: int) -> dict[str, Any]:
    engines = [create_engine(url), create_engine(url)]
    try:
        await migrate(engines[0])
        factories = [session_factory(e) for e in engines]
        entry = AuditEntry("command", "run", session_id="ses_0123456789abcdefghij", detail=_DETAIL)
        out: dict[str, Any] = {}

        t0 = time.perf_counter()
        for _ in range(events):
            await audit_trail.write(engines[0], "single", [entry])
        out["one_writer_events_per_s"] = events / (time.perf_counter() - t0)

        writers = 8

        async def writer(n: int) -> None:
            for _ in range(events // writers):
                await audit_trail.write(engines[n % 2], "concurrent", [entry])

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(n) for n in range(writers)))
        elapsed = time.perf_counter() - t0
        out["eight_writers_two_engines_events_per_s"] = (events // writers * writers) / elapsed

        page = [AuditEntry("egress", "http", session_id="ses_0123456789abcdefghij",
                           detail={"destination": "api.example.com:443", "method": "GET", "path": "/x",
                                   "status": 200, "decision": "allow", "bytes_in": 512})] * 1000
        pages = max(2, events // 1000)
        t0 = time.perf_counter()
        for _ in range(pages):
            await audit_trail.write(engines[0], "pages", page)
        out["pages_of_1000_events_per_s"] = pages * 1000 / (time.perf_counter() - t0)

        async with factories[0]() as db:
            t0 = time.perf_counter()
            checked = await audit_trail.verify(db, "pages")
            out["verify_events_per_s"] = checked.checked / (time.perf_counter() - t0)
            assert checked.ok and (await audit_trail.verify(db, "concurrent")).ok
        return out
    finally:
        for engine in engines:
            await engine.dispose()


@contextlib.contextmanager
def _recording(enabled: bool) -> Iterator[None]:
    original = audit_middleware.AuditMiddleware._write

    async def skip(*_args: Any, **_kwargs: Any) -> None:
        return None

    if not enabled:
        audit_middleware.AuditMiddleware._write = skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        audit_middleware.AuditMiddleware._write = original  # type: ignore[method-assign]


async def per_command(commands: int, tmp: Path) -> dict[str, Any]:
    stack = ApiStack(f"sqlite+aiosqlite:///{tmp}/api.db", FakeRuntime(), fake_image(tmp / "image"),
                     settings={"command_limit": 1_000_000, "reaper_interval": 0,
                               "rolling_snapshot_interval": 0})
    await stack.start()
    try:
        key = await stack.tenant_key("bench")
        times: dict[str, list[float]] = {"with_audit": [], "without_audit": []}
        async with stack.client(key) as c:
            sid = (await c.post("/v1/sessions", json={})).json()["id"]
            for _ in range(10):
                await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
            rounds = 10
            for _ in range(rounds):  # interleaved, so load changes hit both alike
                for name in times:
                    with _recording(name == "with_audit"):
                        for _ in range(commands // rounds):
                            t0 = time.perf_counter()
                            response = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
                            times[name].append((time.perf_counter() - t0) * 1000)
                            assert response.status_code == 200, response.text
            throughput: dict[str, list[float]] = {"with_audit": [], "without_audit": []}
            clients = 8

            async def loop(count: int) -> None:
                for _ in range(count):
                    response = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["true"]})
                    assert response.status_code == 200, response.text

            for _ in range(3):
                for name in throughput:
                    with _recording(name == "with_audit"):
                        t0 = time.perf_counter()
                        await asyncio.gather(*(loop(commands // clients // 3 or 1) for _ in range(clients)))
                        elapsed = time.perf_counter() - t0
                        throughput[name].append(clients * (commands // clients // 3 or 1) / elapsed)
            chained = (await c.get("/v1/audit/verify")).json()
        out: dict[str, Any] = {name: summary(values) for name, values in times.items()}
        out["concurrent_8_clients_commands_per_s"] = {name: summary(v) for name, v in throughput.items()}
        out["added_p50_ms"] = out["with_audit"]["p50"] - out["without_audit"]["p50"]
        out["added_mean_ms"] = out["with_audit"]["mean"] - out["without_audit"]["mean"]
        out["chain_after"] = chained
        return out
    finally:
        await stack.stop()


async def bench(events: int, commands: int, postgres: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"host": host_facts(), "events": events, "commands": commands}
    with tempfile.TemporaryDirectory(prefix="capsa-audit-bench-") as tmp:
        results["store"] = {"sqlite": await store_bench(f"sqlite+aiosqlite:///{tmp}/store.db", events)}
        reason = postgres_missing_reason() if postgres else "--no-postgres"
        if reason is None:
            with temporary_postgres() as cluster:
                results["store"]["postgresql"] = await store_bench(cluster.new_database(), events)
        else:
            results["store"]["postgresql"] = {"skipped": reason}
        results["per_command"] = await per_command(commands, Path(tmp))
    results["host"]["loadavg_at_end"] = list(os.getloadavg())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--commands", type=int, default=300)
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "audit_write.json")
    args = parser.parse_args()
    results = asyncio.run(bench(args.events, args.commands, not args.no_postgres))
    write_results(args.out, results)
    for backend, figures in results["store"].items():
        print(backend, {k: round(v, 1) if isinstance(v, float) else v for k, v in figures.items()})
    pc = results["per_command"]
    print(f"per command (true, fake runtime, SQLite): with audit p50 {pc['with_audit']['p50']:.2f} ms, "
          f"without {pc['without_audit']['p50']:.2f} ms, added p50 {pc['added_p50_ms']:.2f} ms "
          f"mean {pc['added_mean_ms']:.2f} ms")
    conc = pc["concurrent_8_clients_commands_per_s"]
    print(f"8 concurrent clients: with audit {conc['with_audit']['p50']:.1f} commands/s, without "
          f"{conc['without_audit']['p50']:.1f}")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

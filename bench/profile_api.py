"""Where an API command's time goes on the host: ``commands.run("true")`` through the SDK against
`capsa serve` (in this process), split into the parts the control plane and the node spend it on.

Each part is timed by wrapping the function that does it (nothing in the product changes): the control
plane's whole ASGI call for ``POST /v1/sessions/{id}/commands`` (and until its response head goes out), the
API key check, the session lookup, the audit commit (after the answer by default: CAPSA_AUDIT_ACK), the node
call (in-process in ``capsa serve``: NodeClient with the node's app), the node agent's exec and the guest
channel's exec inside it. Alongside: a trivial authenticated ``GET /v1/sessions/{id}`` and the
unauthenticated ``GET /v1/ready`` over one kept-alive connection, which show the HTTP stack's own cost.
Writes bench/results/profile_api.json.

    .venv/bin/python bench/profile_api.py [--n 40]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

import capsa.control.audit.writer as audit_writer
import capsa.control.deps as deps
import capsa.control.nodes.client as nodeclient
import capsa.control.sessions.relay as relay
import capsa.control.sessions.service as control_sessions
import capsa.node.agent.agent as agent
import capsa.node.agent.guest as guest_facade
import capsa.node.guestlink.client as guest_client
import capsa.node.guestlink.identity as identity
import capsa.node.templates.source as template_source
import capsa.serve as serve_module
from capsa.sdk import AsyncSession
from harness import host_facts, pool_settled, summary, write_results
from session_ops import serving

RESULTS = Path(__file__).with_name("results") / "profile_api.json"
SAMPLES: dict[str, list[float]] = {}


def _record(label: str, seconds: float) -> None:
    SAMPLES.setdefault(label, []).append(seconds)


def _timed(label: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _record(label, time.perf_counter() - start)
    return wrapper


class _TimedApp:
    """The control plane's ASGI app, timing its command calls (other requests pass through)."""

    def __init__(self, app: Any) -> None:
        self.__dict__["_app"] = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and scope.get("method") == "POST" and path == "/v1/sessions":
            start = time.perf_counter()
            try:
                await self._app(scope, receive, send)
            finally:
                _record("create: control app whole call", time.perf_counter() - start)
            return
        if scope["type"] != "http" or not path.endswith("/commands"):
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                _record("control app: to response head", time.perf_counter() - start)
            await send(message)

        try:
            await self._app(scope, receive, timed_send)
        finally:
            _record("control app: whole call", time.perf_counter() - start)


def _instrument() -> None:
    for owner, name, label in (
            (deps, "authenticate_cached", "auth (API key, cached per replica)"),
            (relay, "running", "session lookup (relay.running)"),
            (audit_writer.AuditWriter, "_drain", "audit commit (after the answer: CAPSA_AUDIT_ACK=async)"),
            (nodeclient.NodeClient, "exec", "node call (in-process: NodeClient.exec)"),
            (guest_facade.SandboxGuest, "exec", "node agent exec (SandboxGuest.exec)"),
            (guest_client.GuestClient, "exec", "guest channel exec"),
            (control_sessions, "create_session", "create: control plane (sessions.create_session)"),
            (nodeclient.NodeClient, "create_sandbox", "create: node call (in-process)"),
            (agent.NodeAgent, "create", "create: node agent create"),
            (template_source.TemplateSource, "make", "create: template source make (pool take + bind)"),
            (identity, "bind_identity", "create: identity bind (reseed, clock, hostname)")):
        setattr(owner, name, _timed(label, getattr(owner, name)))
    build_app = serve_module.__dict__["build_app"]
    setattr(serve_module, "build_app", lambda *a, **k: _TimedApp(build_app(*a, **k)))  # noqa: B010


async def _series(label: str, n: int, call: Callable[[], Awaitable[Any]], warm: int = 5) -> None:
    for _ in range(warm):
        await call()
    for _ in range(n):
        start = time.perf_counter()
        await call()
        _record(label, time.perf_counter() - start)


async def measure_creates(state: Path, accel: str, n: int) -> None:
    """Sessions from a warm pool of one (the bench waits for each refill): the create's parts."""
    async with serving(state, accel, {"base": 1}) as (url, key, made):
        for _ in range(n):
            await pool_settled(state, live=0, quiet_s=2.0, quiet_cpu_s=0.2)
            start = time.perf_counter()
            session = await AsyncSession.create(timeout=3600, api_url=url, api_key=key)
            _record("create: SDK AsyncSession.create", time.perf_counter() - start)
            made.append(session)
            await session.close()
            made.remove(session)


async def measure(state: Path, accel: str, n: int) -> None:
    async with serving(state, accel, {}) as (url, key, made):
        session = await AsyncSession.create(timeout=3600, api_url=url, api_key=key)
        made.append(session)
        await _series("SDK commands.run(true)", 0, lambda: session.commands.run("true"), warm=10)
        SAMPLES.clear()  # the parts of the warm-up calls
        await _series("SDK commands.run(true)", n, lambda: session.commands.run("true"), warm=0)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            await _series("GET /v1/sessions/{id} (kept-alive)", n,
                          lambda: http.get(f"/v1/sessions/{session.id}"))
            await _series("GET /v1/ready (kept-alive)", n, lambda: http.get("/v1/ready"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    facts = host_facts()
    _instrument()
    state = Path(tempfile.mkdtemp(prefix="capsa-profile-api-", dir="/var/tmp"))
    state.chmod(0o755)
    try:
        asyncio.run(measure(state / "commands", args.accel, args.n))
        asyncio.run(measure_creates(state / "creates", args.accel, max(5, args.n // 4)))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    parts = {label: summary(values) for label, values in SAMPLES.items()}
    write_results(args.out, {"host": facts, "end_load": list(os.getloadavg()), "n": args.n, "parts": parts})
    table = Table(title="API command breakdown (ms)")
    for column in ("part", "n", "p50", "p95"):
        table.add_column(column)
    for label, entry in parts.items():
        table.add_row(label, str(len(SAMPLES[label])), f"{entry['p50'] * 1000:.1f}",
                      f"{entry['p95'] * 1000:.1f}")
    Console().print(table)
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

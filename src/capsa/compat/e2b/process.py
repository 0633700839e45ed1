"""envd's ``process.Process`` service on capsa's guest processes.

Every ``Start`` is a capsa background process (``proc_start`` through the session's node), so it has a
real pid from its first message on: the E2B SDK runs foreground and background commands through the same
stream and kills or reconnects by pid. Output reaches the stream by following the process's output
buffers (:func:`follow`), until the process ends; then the ``end`` event carries its exit. A stream whose
client goes away leaves the process running (the SDK's ``disconnect``); a stream past its
``Connect-Timeout-Ms`` kills the process and ends with ``deadline_exceeded`` (the SDK's command timeout).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from capsa.common import node_api
from capsa.compat.e2b.access import EnvdTarget
from capsa.compat.e2b.connect import ConnectError
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.sessions import node_call_failed

__all__ = ["KEEPALIVE_S", "SIGNALS", "follow", "guest_user", "list_processes", "send_signal", "start_request",
           "stream_process", "user_from_authorization"]

SIGNALS = {"SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9, 15: 15, 9: 9}
KEEPALIVE_S = 50.0
"""Idle seconds between keepalive events on a stream (the SDK announces a 50 s ping interval)."""
_POLL_MIN, _POLL_MAX = 0.02, 0.25


def user_from_authorization(header: str | None) -> str | None:
    """The user the SDK names in ``Authorization: Basic base64("<user>:")``; none: the guest's default.

    capsa's guest has no ``user`` account: E2B's default user name means capsa's default user (root)."""
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        user = base64.b64decode(header[6:].strip()).decode().split(":", 1)[0]
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConnectError("unauthenticated", "malformed Authorization header") from exc
    return guest_user(user)


def guest_user(name: str | None) -> str | None:
    """The capsa user for an E2B user name: None (the guest's default, root) for ``user`` and ``root``."""
    return None if name in (None, "", "user", "root") else name


def start_request(message: dict[str, Any], user: str | None) -> node_api.ProcessStart:
    if message.get("pty"):
        raise ConnectError("unimplemented", "PTY processes are not supported by capsa's E2B layer yet")
    config = message.get("process")
    if not isinstance(config, dict) or not isinstance(config.get("cmd"), str) or not config["cmd"]:
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = config.get("args") or []
    envs = config.get("envs") or {}
    cwd = config.get("cwd") or None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise ConnectError("invalid_argument", "process.envs must map names to strings")
    try:
        return node_api.ProcessStart(cmd=[config["cmd"], *args], env=envs, cwd=cwd, user=user)
    except ValueError as exc:
        raise ConnectError("invalid_argument", str(exc).splitlines()[0]) from exc


def _selected_pid(message: dict[str, Any]) -> int:
    selector = message.get("process") or {}
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if isinstance(pid, int) and pid > 0:
        return pid
    if isinstance(selector, dict) and "tag" in selector:
        raise ConnectError("unimplemented", "selecting a process by tag is not supported by capsa")
    raise ConnectError("invalid_argument", "process.pid is required")


async def _guest(control: ControlPlane, target: EnvdTarget, call: Any) -> Any:
    try:
        return await call
    except NodeError as exc:
        raise await node_call_failed(control, target.row, exc) from exc


def _end_event(out: node_api.ProcessOutput | node_api.ProcessInfo) -> dict[str, Any]:
    if out.signal is not None:
        name = {9: "killed", 15: "terminated", 2: "interrupt"}.get(out.signal, f"signal {out.signal}")
        return {"end": {"exitCode": -1, "exited": False, "status": f"signal: {name}"}}
    code = out.exit_code if out.exit_code is not None else -1
    return {"end": {"exitCode": code, "exited": True, "status": f"exit status {code}"}}


def _data(channel: str, text: str) -> dict[str, Any]:
    return {"event": {"data": {channel: base64.b64encode(text.encode()).decode()}}}


async def follow(control: ControlPlane, target: EnvdTarget, pid: int, *, from_start: bool,
                 deadline: float | None) -> AsyncIterator[dict[str, Any]]:
    """The stream's messages after ``start``: new output as ``data`` events, then ``end``.

    Follows the process's output buffers (capsa keeps the last 1 MiB per stream: output written faster
    than it is followed past that is lost). ``from_start``: also what it wrote before now."""
    seen = {"stdout": 0, "stderr": 0}
    if not from_start:
        now = await _guest(control, target, target.client.process_output(target.sandbox_id, pid))
        seen = {"stdout": len(now.stdout), "stderr": len(now.stderr)}
    delay, idle_since = _POLL_MIN, time.monotonic()
    while True:
        out: node_api.ProcessOutput = await _guest(
            control, target, target.client.process_output(target.sandbox_id, pid))
        fresh = False
        for channel, text in (("stdout", out.stdout), ("stderr", out.stderr)):
            if len(text) < seen[channel]:  # the ring buffer dropped its head: follow from its new end
                seen[channel] = 0
            if len(text) > seen[channel]:
                yield _data(channel, text[seen[channel]:])
                seen[channel] = len(text)
                fresh = True
        if not out.running:
            yield {"event": _end_event(out)}
            return
        now_t = time.monotonic()
        if deadline is not None and now_t >= deadline:
            await _guest(control, target, target.client.kill_process(target.sandbox_id, pid, 9))
            raise ConnectError("deadline_exceeded", "the command ran past its timeout and was killed")
        if fresh:
            delay, idle_since = _POLL_MIN, now_t
        else:
            delay = min(delay * 1.5, _POLL_MAX)
            if now_t - idle_since >= KEEPALIVE_S:
                yield {"event": {"keepalive": {}}}
                idle_since = now_t
        await asyncio.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now_t)))


def _deadline(timeout_ms: str | None) -> float | None:
    if not timeout_ms:
        return None
    try:
        ms = int(timeout_ms)
    except ValueError as exc:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be an integer") from exc
    return time.monotonic() + ms / 1000 if ms > 0 else None


async def stream_process(control: ControlPlane, target: EnvdTarget, message: dict[str, Any], *,
                         start: node_api.ProcessStart | None, timeout_ms: str | None,
                         ) -> AsyncIterator[dict[str, Any]]:
    """``Start`` (``start`` given) or ``Connect`` (an existing pid): the start event, output, the end."""
    deadline = _deadline(timeout_ms)
    if start is not None:
        info: node_api.ProcessInfo = await _guest(
            control, target, target.client.start_process(target.sandbox_id, start))
        pid = info.pid
    else:
        pid = _selected_pid(message)
        info = await _guest(control, target, target.client.get_process(target.sandbox_id, pid))
        if not info.running:
            raise ConnectError("not_found", f"process {pid} is not running")
    yield {"event": {"start": {"pid": pid}}}
    async for event in follow(control, target, pid, from_start=start is not None, deadline=deadline):
        yield event


async def list_processes(control: ControlPlane, target: EnvdTarget) -> dict[str, Any]:
    items: list[node_api.ProcessInfo] = await _guest(
        control, target, target.client.list_processes(target.sandbox_id))
    return {"processes": [
        {"pid": p.pid, "config": {"cmd": p.cmd[0] if p.cmd else "", "args": p.cmd[1:], "envs": {}}}
        for p in items if p.running]}


async def send_signal(control: ControlPlane, target: EnvdTarget, message: dict[str, Any]) -> dict[str, Any]:
    pid = _selected_pid(message)
    signal = SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise ConnectError("invalid_argument", f"unsupported signal {message.get('signal')!r}")
    await _guest(control, target, target.client.kill_process(target.sandbox_id, pid, signal))
    return {}

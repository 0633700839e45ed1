"""envd's ``process.Process`` service on capsa's guest processes and terminals.

Every plain ``Start`` is a capsa background process (``proc_start`` through the session's node, with a
stdin pipe when the SDK asks for one), so it has a real pid from its first message on: the E2B SDK runs
foreground and background commands through the same stream and kills, feeds or reconnects by pid. Its
output reaches the stream through the node's process output stream (``proc_stream``) until the process
ends; the ``end`` event carries its exit. A ``Start`` with ``pty`` opens a capsa terminal (the node's
``/pty`` WebSocket); its input, resize and kill arrive on other requests, so this replica keeps the open
terminals by session and pid (:class:`Terminals`). Streams, stdin and terminals go through
:mod:`capsa.control.sessions.process_io`, the core the ``/v1`` routes use (tenant check, session activity
while open, a lost sandbox handled).

A stream whose client goes away leaves a process running (the SDK's ``disconnect``) and hangs a terminal
up; a stream past its ``Connect-Timeout-Ms`` kills the process and ends with ``deadline_exceeded`` (the
SDK's command timeout). Idle streams get keepalive events (:func:`capsa.compat.e2b.connect.paced`).
"""

from __future__ import annotations

import base64
import shlex
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from capsa.common import node_api
from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import TerminalClient, TerminalOptions
from capsa.common.wire.streams import OutputChunk, OutputEnd
from capsa.compat.e2b.access import EnvdTarget
from capsa.compat.e2b.connect import ConnectError, paced
from capsa.control.audit import trail as audit_trail
from capsa.control.plane import ControlPlane
from capsa.control.ports.access import keep_active
from capsa.control.sessions import process_io, relay

__all__ = ["SIGNALS", "StartSpec", "Terminals", "close_stdin", "guest_user", "list_processes",
           "selected_pid", "send_input", "send_signal", "start_request", "stream_process", "update_process",
           "user_from_authorization"]

SIGNALS = {"SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9, 15: 15, 9: 9}


def guest_user(name: str | None) -> str | None:
    """The capsa user for an E2B user name: None (the guest's default, root) for ``user`` and ``root``.

    capsa's guest has no ``user`` account: E2B's default user name means capsa's default user."""
    return None if name in (None, "", "user", "root") else name


def user_from_authorization(header: str | None) -> str | None:
    """The user the SDK names in ``Authorization: Basic base64("<user>:")``; none: the guest's default."""
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        user = base64.b64decode(header[6:].strip()).decode().split(":", 1)[0]
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConnectError("unauthenticated", "malformed Authorization header") from exc
    return guest_user(user)


@dataclass(frozen=True)
class StartSpec:
    """A parsed ``StartRequest``: the process, and the terminal size when it asks for a PTY."""

    process: node_api.ProcessStart
    pty: tuple[int, int] | None = None
    """(cols, rows)."""


def start_request(message: dict[str, Any], user: str | None) -> StartSpec:
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
    pty: tuple[int, int] | None = None
    if message.get("pty") is not None:
        size = (message["pty"] or {}).get("size") or {}
        cols, rows = size.get("cols", 80), size.get("rows", 24)
        if not all(isinstance(v, int) and 0 < v <= 10000 for v in (cols, rows)):
            raise ConnectError("invalid_argument", "pty.size needs cols and rows in 1..10000")
        pty = (cols, rows)
    try:
        start = node_api.ProcessStart(cmd=[config["cmd"], *args], env=envs, cwd=cwd, user=user,
                                      open_stdin=message.get("stdin") is True)
    except ValueError as exc:
        raise ConnectError("invalid_argument", str(exc).splitlines()[0]) from exc
    return StartSpec(start, pty)


def selected_pid(message: dict[str, Any]) -> int:
    selector = message.get("process") or {}
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if isinstance(pid, int) and pid > 0:
        return pid
    if isinstance(selector, dict) and "tag" in selector:
        raise ConnectError("unimplemented", "selecting a process by tag is not supported by capsa")
    raise ConnectError("invalid_argument", "process.pid is required")


def _end_event(exit_code: int | None, signal: int | None) -> dict[str, Any]:
    if signal is not None:
        name = {9: "killed", 15: "terminated", 1: "hangup", 2: "interrupt"}.get(signal, f"signal {signal}")
        return {"event": {"end": {"exitCode": -1, "exited": False, "status": f"signal: {name}"}}}
    code = exit_code if exit_code is not None else -1
    return {"event": {"end": {"exitCode": code, "exited": True, "status": f"exit status {code}"}}}


def _data(channel: str, raw: bytes) -> dict[str, Any]:
    return {"event": {"data": {channel: base64.b64encode(raw).decode()}}}


@dataclass
class Terminals:
    """The PTYs this replica relays, by (session id, pid): input, resize and kill find them here."""

    open: dict[tuple[str, int], TerminalClient] = field(default_factory=dict)

    def get(self, target: EnvdTarget, pid: int) -> TerminalClient | None:
        return self.open.get((target.id, pid))


async def _process_output(control: ControlPlane, target: EnvdTarget, pid: int,
                          ) -> AsyncIterator[dict[str, Any]]:
    stream = await process_io.stream_output(control, target.principal.tenant, target.id, pid)
    try:
        async for event in stream:
            if isinstance(event, OutputChunk):
                if event.data:
                    yield _data(event.ch, event.data.encode())
            elif isinstance(event, OutputEnd):
                yield _end_event(event.exit_code, event.signal)
                return
            else:
                raise CapsaError(event.detail, code=event.code, status=502)
    finally:
        await stream.aclose()
    raise ConnectError("unavailable", "the process output stream ended before the process did")


async def _terminal_output(control: ControlPlane, terminals: Terminals, target: EnvdTarget,
                           terminal: TerminalClient,
                           ) -> AsyncIterator[dict[str, Any]]:
    key = (target.id, terminal.pid)
    terminals.open[key] = terminal
    try:
        async with keep_active(control, target.id):  # an open terminal is activity
            while (chunk := await terminal.recv()) is not None:
                yield _data("pty", chunk)
        ended = terminal.exit
        yield _end_event(ended.exit_code if ended else None, ended.signal if ended else 1)
    finally:
        terminals.open.pop(key, None)
        await terminal.close()


def _deadline(timeout_ms: str | None) -> float | None:
    if not timeout_ms:
        return None
    try:
        ms = int(timeout_ms)
    except ValueError as exc:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be an integer") from exc
    return time.monotonic() + ms / 1000 if ms > 0 else None


async def stream_process(control: ControlPlane, terminals: Terminals, target: EnvdTarget,
                         message: dict[str, Any], *, start: StartSpec | None, timeout_ms: str | None,
                         ) -> AsyncIterator[Mapping[str, Any]]:
    """``Start`` (``start`` given) or ``Connect`` (an existing pid): the start event, output, the end.

    ``Connect`` replays the output the guest still holds for the process (up to 1 MiB per stream), then
    follows it."""
    deadline = _deadline(timeout_ms)
    source: AsyncIterator[dict[str, Any]]
    if start is not None and start.pty is not None:
        spec = start.process
        cmd = spec.cmd if isinstance(spec.cmd, str) else shlex.join(spec.cmd)
        options = TerminalOptions(cols=start.pty[0], rows=start.pty[1], cmd=cmd, env=spec.env or None,
                                  cwd=spec.cwd, user=spec.user)
        terminal = await process_io.open_terminal(control, target.principal.tenant, target.id, options)
        pid = terminal.pid
        source = _terminal_output(control, terminals, target, terminal)

        async def on_deadline() -> None:
            await terminal.kill()
    else:
        if start is not None:
            spec = start.process
            started = await process_io.start_background(
                control, target.principal.tenant, target.id, spec.cmd, env=dict(spec.env), cwd=spec.cwd,
                user=spec.user, open_stdin=spec.open_stdin)
            pid = started.pid
        else:
            wanted = selected_pid(message)
            info = await relay.call(target.session, lambda node, sandbox: node.get_process(sandbox, wanted))
            if not info.running:
                raise ConnectError("not_found", f"process {info.pid} is not running")
            pid = info.pid
        source = _process_output(control, target, pid)

        async def on_deadline() -> None:
            await relay.call(target.session, lambda node, sandbox: node.kill_process(sandbox, pid, 9))
    if start is not None:
        spec = start.process
        audit_trail.note("command", "start", session_id=target.id, detail={
            "argv": spec.cmd if isinstance(spec.cmd, str) else list(spec.cmd),
            "shell": isinstance(spec.cmd, str), "cwd": spec.cwd, "user": spec.user,
            "env_keys": sorted(spec.env), "pid": pid, "pty": start.pty is not None, "via": "e2b"})
    yield {"event": {"start": {"pid": pid}}}
    async for event in paced(source, {"event": {"keepalive": {}}}, deadline=deadline, on_deadline=on_deadline,
                             deadline_message="the command ran past its timeout and was killed"):
        yield event


async def list_processes(control: ControlPlane, terminals: Terminals, target: EnvdTarget) -> dict[str, Any]:
    items = await relay.call(target.session, lambda node, sandbox: node.list_processes(sandbox))
    processes = [{"pid": p.pid, "config": {"cmd": p.cmd[0] if p.cmd else "", "args": p.cmd[1:], "envs": {}}}
                 for p in items if p.running]
    processes += [{"pid": pid, "config": {"cmd": "pty", "args": [], "envs": {}}}
                  for (session, pid) in terminals.open if session == target.id]
    return {"processes": processes}


def _input(message: dict[str, Any]) -> tuple[str, bytes]:
    given = message.get("input") or {}
    for channel in ("stdin", "pty"):
        if isinstance(given.get(channel), str):
            try:
                return channel, base64.b64decode(given[channel], validate=True)
            except ValueError as exc:
                raise ConnectError("invalid_argument", f"input.{channel} is not base64") from exc
    raise ConnectError("invalid_argument", "input.stdin or input.pty is required")


async def send_input(control: ControlPlane, terminals: Terminals, target: EnvdTarget,
                     message: dict[str, Any]) -> dict[str, Any]:
    pid = selected_pid(message)
    channel, data = _input(message)
    terminal = terminals.get(target, pid)
    if terminal is not None:
        await terminal.send(data)
    elif channel == "pty":
        raise ConnectError("not_found", f"no terminal {pid} on this server")
    else:
        await process_io.send_stdin(control, target.principal.tenant, target.id, pid, data)
    return {}


async def close_stdin(control: ControlPlane, target: EnvdTarget, message: dict[str, Any]) -> dict[str, Any]:
    await process_io.close_stdin(control, target.principal.tenant, target.id, selected_pid(message))
    return {}


async def update_process(terminals: Terminals, target: EnvdTarget, message: dict[str, Any]) -> dict[str, Any]:
    """``Update``: a terminal's new size."""
    pid = selected_pid(message)
    terminal = terminals.get(target, pid)
    if terminal is None:
        raise ConnectError("not_found", f"no terminal {pid} on this server")
    size = (message.get("pty") or {}).get("size") or {}
    cols, rows = size.get("cols"), size.get("rows")
    if not (isinstance(cols, int) and isinstance(rows, int) and 0 < cols <= 10000 and 0 < rows <= 10000):
        raise ConnectError("invalid_argument", "pty.size needs cols and rows in 1..10000")
    await terminal.resize(cols, rows)
    return {}


async def send_signal(control: ControlPlane, terminals: Terminals, target: EnvdTarget,
                      message: dict[str, Any]) -> dict[str, Any]:
    pid = selected_pid(message)
    signal = SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise ConnectError("invalid_argument", f"unsupported signal {message.get('signal')!r}")
    terminal = terminals.get(target, pid)
    if terminal is not None:
        await terminal.kill()  # a terminal's whole process group gets SIGKILL
    else:
        await relay.call(target.session, lambda node, sandbox: node.kill_process(sandbox, pid, signal))
    return {}

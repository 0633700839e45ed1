"""The terminal protocol: a pseudo-terminal in a sandbox, carried in WebSocket messages.

Served by the node (``/node/v1/sandboxes/{id}/pty``) and by the control plane (``/v1/sessions/{id}/pty``),
with the same query parameters (``cols``, ``rows``, optional ``cmd`` (a shell command line; default the
login shell), ``cwd``, ``user``, ``env=NAME=VALUE`` repeated) and the same messages:

- BINARY messages are terminal bytes: keyboard input from the client, terminal output from the server;
- TEXT messages are JSON control messages. From the server: ``{"type": "started", "pid": N}`` once the
  terminal runs (always the first message), ``{"type": "exit", "exit_code": N|null, "signal": N|null}``
  when its command ended (then the server closes with 1000), ``{"type": "error", "status", "code",
  "detail"}`` when it could not start or broke (then it closes). From the client: ``{"type": "resize",
  "cols": C, "rows": R}``, and ``{"type": "kill"}`` (SIGKILL to the terminal's process group; the
  ``exit`` message follows).

The client closing the WebSocket hangs the terminal up too. :class:`TerminalClient` is the client end
(used by the control plane towards a node and by the SDK towards the control plane).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from capsa.common.errors import CapsaError
from capsa.common.websocket import ByteStream, WebSocketClient, WebSocketRejected, receive_first_json, upgrade

__all__ = [
    "MAX_SIZE",
    "TerminalClient",
    "TerminalExit",
    "TerminalOptions",
    "error_message",
    "exit_message",
    "follow_control",
    "parse_client_message",
    "started_message",
]

MAX_SIZE = 10000
"""Largest ``cols``/``rows`` (the guest's own bound)."""


@dataclass(frozen=True)
class TerminalOptions:
    """What a terminal runs and how big it starts (validated by :meth:`check`)."""

    cols: int = 80
    rows: int = 24
    cmd: str | None = None
    """A shell command line (``/bin/sh -c``); None: the user's login shell, interactive."""
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    user: str | None = None

    def check(self) -> TerminalOptions:
        for name, value in (("cols", self.cols), ("rows", self.rows)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
                raise _invalid(f"{name} must be an integer between 1 and {MAX_SIZE}")
        if self.cmd is not None and (not self.cmd.strip() or "\0" in self.cmd):
            raise _invalid("cmd must be a non-empty command line")
        if self.cwd is not None and not self.cwd.startswith("/"):
            raise _invalid("cwd must be an absolute path")
        for key in self.env or {}:
            if not key or "=" in key or "\0" in key:
                raise _invalid(f"invalid environment variable name {key!r}")
        return self

    def query(self) -> str:
        params: list[tuple[str, str]] = [("cols", str(self.cols)), ("rows", str(self.rows))]
        for key, value in (("cmd", self.cmd), ("cwd", self.cwd), ("user", self.user)):
            if value is not None:
                params.append((key, value))
        params += [("env", f"{k}={v}") for k, v in (self.env or {}).items()]
        return urlencode(params)

    @classmethod
    def from_query(cls, items: Sequence[tuple[str, str]]) -> TerminalOptions:
        """Parse query parameters (422 ``validation_error`` on bad ones)."""
        values: dict[str, str] = {}
        env: dict[str, str] = {}
        for key, value in items:
            if key == "env":
                name, sep, val = value.partition("=")
                if not sep:
                    raise _invalid("env must be NAME=VALUE")
                env[name] = val
            elif key in ("cols", "rows", "cmd", "cwd", "user"):
                values[key] = value
        sizes: dict[str, int] = {}
        for name, default in (("cols", 80), ("rows", 24)):
            raw = values.get(name)
            try:
                sizes[name] = default if raw is None else int(raw)
            except ValueError:
                raise _invalid(f"{name} must be an integer between 1 and {MAX_SIZE}") from None
        return cls(cols=sizes["cols"], rows=sizes["rows"], cmd=values.get("cmd"), env=env or None,
                   cwd=values.get("cwd"), user=values.get("user")).check()


@dataclass(frozen=True)
class TerminalExit:
    exit_code: int | None
    signal: int | None


def started_message(pid: int) -> str:
    return json.dumps({"type": "started", "pid": pid})


def exit_message(exit_code: int | None, signal: int | None) -> str:
    return json.dumps({"type": "exit", "exit_code": exit_code, "signal": signal})


def error_message(status: int, code: str, detail: str) -> str:
    return json.dumps({"type": "error", "status": status, "code": code, "detail": detail})


def parse_client_message(text: str) -> tuple[str, int, int]:
    """A client's control message: ("resize", cols, rows), ("kill", 0, 0), or ("ignored", 0, 0)."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        return "ignored", 0, 0
    if not isinstance(body, dict):
        return "ignored", 0, 0
    if body.get("type") == "kill":
        return "kill", 0, 0
    if body.get("type") == "resize":
        cols, rows = body.get("cols"), body.get("rows")
        if all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIZE for v in (cols, rows)):
            assert isinstance(cols, int) and isinstance(rows, int)
            return "resize", cols, rows
    return "ignored", 0, 0


async def follow_control(text: str, *, resize: Callable[[int, int], Awaitable[None]],
                         kill: Callable[[], Awaitable[None]]) -> None:
    """Carry out a client's control message (:func:`parse_client_message`): ``resize(cols, rows)`` or
    ``kill()``; anything else is ignored."""
    kind, cols, rows = parse_client_message(text)
    if kind == "resize":
        await resize(cols, rows)
    elif kind == "kill":
        await kill()


def _invalid(message: str) -> CapsaError:
    return CapsaError(message, code="validation_error", status=422)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _refusal(body: object, status: int = 502) -> CapsaError:
    if isinstance(body, dict):
        given = body.get("status")
        code = body.get("code") or "terminal_failed"
        detail = body.get("detail") or "the terminal could not be opened"
        return CapsaError(str(detail), code=str(code),
                          status=given if isinstance(given, int) and 400 <= given < 600 else status)
    return CapsaError("the terminal could not be opened", code="terminal_failed", status=status)


def _rejected(exc: WebSocketRejected) -> CapsaError:
    try:
        refused = json.loads(exc.body) if exc.body else {}
    except ValueError:
        refused = {}
    return _refusal(refused, exc.status)


class TerminalClient:
    """The client end of a terminal: ``send``, ``resize``, ``kill``, ``recv`` (bytes; None once it ended),
    ``exit`` (set once the server said how the command ended), ``close``."""

    def __init__(self, ws: WebSocketClient, pid: int) -> None:
        self._ws = ws
        self.pid = pid
        self.exit: TerminalExit | None = None
        self.closed = False

    @classmethod
    async def connect(cls, stream: ByteStream, host: str, target: str, *,
                      headers: Sequence[tuple[str, str]] = ()) -> TerminalClient:
        """Upgrade ``stream`` at ``target`` and wait for the terminal to start; a refusal raises
        CapsaError with the server's status and code."""
        ws = await upgrade(stream, host, target, headers=headers, refused=_rejected)
        first, body = await receive_first_json(ws, bad="the terminal sent a bad first message",
                                               code="terminal_failed")
        pid = _int_or_none(body.get("pid")) if isinstance(body, dict) else None
        if not isinstance(body, dict) or body.get("type") != "started" or pid is None:
            await ws.close()
            if first is None and ws.close_reason:
                raise CapsaError(ws.close_reason, code="terminal_failed", status=502)
            raise _refusal(body)
        return cls(ws, pid)

    async def send(self, data: bytes) -> None:
        if data:
            await self._ws.send(data)

    async def resize(self, cols: int, rows: int) -> None:
        await self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def kill(self) -> None:
        await self._ws.send(json.dumps({"type": "kill"}))

    async def recv(self) -> bytes | None:
        """The next piece of terminal output; None once the terminal ended (``exit`` says how, when the
        server said). A terminal that broke raises CapsaError."""
        while not self.closed:
            message = await self._ws.receive()
            if message is None:
                self.closed = True
                if self.exit is None and self._ws.close_code not in (1000, None):
                    raise CapsaError(f"the terminal broke (WebSocket close {self._ws.close_code}: "
                                     f"{self._ws.close_reason})", code="terminal_failed", status=502)
                return None
            if isinstance(message, bytes):
                if message:
                    return message
                continue
            try:
                body: Any = json.loads(message)
            except ValueError:
                continue
            if not isinstance(body, dict):
                continue
            if body.get("type") == "exit":
                self.exit = TerminalExit(_int_or_none(body.get("exit_code")),
                                         _int_or_none(body.get("signal")))
            elif body.get("type") == "error":
                self.closed = True
                await self._ws.close()
                raise _refusal(body)
        return None

    async def close(self) -> None:
        """Hang up (if still running) and drop the connection; safe to call twice."""
        self.closed = True
        await self._ws.close()

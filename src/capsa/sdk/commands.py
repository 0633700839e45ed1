"""Running commands in a session: foreground (buffered or streamed) and background processes."""

# The API's `timeout` parameters are the remote deadlines the contract defines, not asyncio timeouts.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import builtins
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, overload

from capsa.common.wire.streams import OUTPUT_EVENT, ExecOutput, OutputChunk, OutputEnd, StreamError
from capsa.sdk.client import AsyncClient
from capsa.sdk.errors import CapsaConnectionError, UnexpectedResponse, error_from_problem
from capsa.sdk.models import (
    EXEC_EVENT,
    CommandResult,
    ExecFinished,
    ProcessInfo,
    ProcessOutput,
    iter_events,
    parse,
)
from capsa.sdk.resource import SessionResource

__all__ = ["AsyncCommands", "AsyncProcess", "OutputCallback"]

OutputCallback = Callable[[str], Awaitable[object] | object]
"""Called with each chunk of decoded output as it arrives; may be a plain function or a coroutine function."""

# How much streamed output the SDK keeps for the returned result; the callbacks still see all of it.
_KEEP_CHARS = 16 * 1024 * 1024
# Margin added to a command's own timeout before the HTTP read gives up (the server enforces the timeout).
_HTTP_MARGIN = 30.0


def _read_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + _HTTP_MARGIN


async def _emit(callback: OutputCallback | None, data: str) -> None:
    if callback is None or not data:
        return
    result = callback(data)
    if inspect.isawaitable(result):
        await result






class _Collector:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.truncated = False

    def add(self, data: str) -> None:
        room = _KEEP_CHARS - self.size
        if room <= 0:
            self.truncated = True
            return
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        self.parts.append(data)
        self.size += len(data)

    def text(self) -> str:
        return "".join(self.parts)


class AsyncProcess(SessionResource):
    """A background process in a session, addressed by its guest pid.

    ``stdout_offset``/``stderr_offset`` are the byte offsets up to which :meth:`stream` (and a streaming
    :meth:`wait`) delivered output: the next stream starts there, so a handle that lost its connection, or
    a new handle from ``commands.connect(pid, stdout_from=..., stderr_from=...)``, gets the rest with
    nothing lost or repeated (while the sandbox still keeps it: the last 1 MiB per stream).
    """

    def __init__(self, client: AsyncClient, session_id: str, info: ProcessInfo, *, stdout_from: int = 0,
                 stderr_from: int = 0) -> None:
        super().__init__(client, session_id)
        self.info = info
        self.stdout_offset = stdout_from
        self.stderr_offset = stderr_from

    @property
    def pid(self) -> int:
        return self.info.pid

    def _path(self, suffix: str = "") -> str:
        return f"{self._base}/processes/{self.pid}{suffix}"

    async def refresh(self) -> ProcessInfo:
        self.info = await self._call(ProcessInfo, "GET", self._path())
        return self.info

    async def output(self) -> ProcessOutput:
        """Everything the process has written so far (the server keeps a bounded amount)."""
        return await self._call(ProcessOutput, "GET", self._path("/output"))

    async def kill(self, signal: int = 15) -> ProcessInfo:
        self.info = await self._call(ProcessInfo, "POST", self._path("/kill"), json={"signal": signal})
        return self.info

    async def send_stdin(self, data: str | bytes) -> ProcessInfo:
        """Write to the process's stdin (a str as UTF-8). It must have been started with ``open_stdin=True``;
        :class:`InvalidState`-like 409 errors (``stdin_closed``, ``process_exited``) otherwise."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self.info = await self._call(ProcessInfo, "POST", self._path("/stdin"), content=raw,
                                     headers={"Content-Type": "application/octet-stream"}, timeout=None)
        return self.info

    async def close_stdin(self) -> ProcessInfo:
        """Close the process's stdin: it reads EOF."""
        self.info = await self._call(ProcessInfo, "POST", self._path("/stdin/close"))
        return self.info

    async def stream(self) -> AsyncIterator[OutputChunk | OutputEnd]:
        """The process's output from ``stdout_offset``/``stderr_offset`` as it is written, then one
        :class:`OutputEnd` when it exited. The offsets advance with every chunk yielded."""
        params = {"stdout_from": self.stdout_offset, "stderr_from": self.stderr_offset}
        async with self._client.stream("GET", self._path("/stream"), params=params, timeout=None) as response:
            async for event in iter_events(response.aiter_lines(), OUTPUT_EVENT, "a process output stream"):
                if isinstance(event, StreamError):
                    raise error_from_problem(0, event.model_dump())
                if isinstance(event, OutputChunk):
                    if event.ch == "stdout":
                        self.stdout_offset = event.offset
                    else:
                        self.stderr_offset = event.offset
                else:
                    self.stdout_offset, self.stderr_offset = event.stdout_end, event.stderr_end
                yield event

    async def wait(self, timeout: float | None = None, *, poll_interval: float = 0.25,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                   reconnects: int = 3) -> ProcessOutput:
        """Wait until the process has exited; ``TimeoutError`` if it still runs after ``timeout`` s.

        With ``on_stdout``/``on_stderr`` the output is streamed to them as it is written (from the handle's
        offsets), and a dropped connection is resumed from the last offsets, up to ``reconnects`` times;
        without, the process is polled every ``poll_interval`` s. Returns what the sandbox kept of its
        output."""
        if on_stdout is not None or on_stderr is not None:
            async with asyncio.timeout(timeout):
                await self._follow(on_stdout, on_stderr, reconnects)
            return await self.output()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            out = await self.output()
            if not out.running:
                return out
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"process {self.pid} still running after {timeout} s")
            await asyncio.sleep(poll_interval)

    async def _follow(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                      reconnects: int) -> None:
        failures = 0
        while True:
            try:
                async for event in self.stream():
                    failures = 0
                    if isinstance(event, OutputChunk):
                        await _emit(on_stdout if event.ch == "stdout" else on_stderr, event.data)
                    else:
                        return
                raise CapsaConnectionError("the process output stream ended before the process did",
                                           url=self._client.config.api_url)
            except CapsaConnectionError:
                failures += 1
                if failures > reconnects:
                    raise
                await asyncio.sleep(min(2.0, 0.2 * failures))

    def __repr__(self) -> str:
        return f"AsyncProcess(pid={self.pid}, running={self.info.running})"


class AsyncCommands(SessionResource):
    """``session.commands``: run commands and manage background processes."""

    @overload
    async def run(self, cmd: str | Sequence[str], *, timeout: float | None = ...,
                  env: Mapping[str, str] | None = ..., cwd: str | None = ..., user: str | None = ...,
                  stdin: str | None = ..., on_stdout: OutputCallback | None = ...,
                  on_stderr: OutputCallback | None = ..., background: Literal[False] = ...,
                  open_stdin: Literal[False] = ...) -> CommandResult: ...

    @overload
    async def run(self, cmd: str | Sequence[str], *, timeout: float | None = ...,
                  env: Mapping[str, str] | None = ..., cwd: str | None = ..., user: str | None = ...,
                  stdin: str | None = ..., on_stdout: OutputCallback | None = ...,
                  on_stderr: OutputCallback | None = ..., background: Literal[True],
                  open_stdin: bool = ...) -> AsyncProcess: ...

    async def run(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                  env: Mapping[str, str] | None = None, cwd: str | None = None, user: str | None = None,
                  stdin: str | None = None, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None, background: bool = False,
                  open_stdin: bool = False) -> CommandResult | AsyncProcess:
        """Run ``cmd`` (a string runs under ``/bin/sh -c``; a list runs as argv).

        A non-zero exit is a normal result, not an exception; so is a timeout (``result.timed_out``).
        With ``on_stdout``/``on_stderr`` the output is streamed to them as it is produced.
        With ``background=True`` the call returns at once with an :class:`AsyncProcess`; add
        ``open_stdin=True`` to write to its stdin later (:meth:`AsyncProcess.send_stdin`).
        """
        body: dict[str, Any] = {
            "cmd": cmd if isinstance(cmd, str) else list(cmd),
            "env": dict(env or {}),
            "cwd": cwd,
            "user": user,
            "timeout": timeout,
            "stdin": stdin,
            "background": background,
        }
        if open_stdin:
            body["open_stdin"] = True
        path = f"{self._base}/commands"
        if background:
            data = await self._client.json("POST", path, json=body)
            return AsyncProcess(self._client, self._session_id, parse(ProcessInfo, data))
        if on_stdout is None and on_stderr is None:
            return await self._call(CommandResult, "POST", path, json=body, timeout=_read_timeout(timeout))
        return await self._run_streaming(path, body, timeout, on_stdout, on_stderr)

    async def _run_streaming(self, path: str, body: dict[str, Any], timeout: float | None,
                             on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
                             ) -> CommandResult:
        out, err = _Collector(), _Collector()
        final: ExecFinished | None = None
        async with self._client.stream("POST", path, json=body, headers={"Accept": "application/x-ndjson"},
                                       timeout=_read_timeout(timeout)) as response:
            if "ndjson" not in response.headers.get("content-type", ""):
                # A server that does not stream answers with the plain result; deliver it in one piece.
                raw = await response.aread()
                try:
                    plain = json.loads(raw)
                except ValueError:
                    raise UnexpectedResponse("a command answer was neither NDJSON nor JSON") from None
                result = parse(CommandResult, plain)
                await _emit(on_stdout, result.stdout)
                await _emit(on_stderr, result.stderr)
                return result
            async for event in iter_events(response.aiter_lines(), EXEC_EVENT, "command output stream"):
                if isinstance(event, ExecOutput):
                    collector, callback = (out, on_stdout) if event.type == "stdout" else (err, on_stderr)
                    collector.add(event.data)
                    await _emit(callback, event.data)
                elif isinstance(event, ExecFinished):
                    final = event
                else:
                    raise error_from_problem(0, event.model_dump())
        if final is None:
            raise CapsaConnectionError("the command output stream ended before the command's result",
                                       url=self._client.config.api_url)
        status = final.model_dump(exclude={"type", "stdout_truncated", "stderr_truncated"})
        return CommandResult(**status, stdout=out.text(), stderr=err.text(),
                             stdout_truncated=final.stdout_truncated or out.truncated,
                             stderr_truncated=final.stderr_truncated or err.truncated)

    async def list(self) -> builtins.list[ProcessInfo]:
        """Background processes of this session (running and finished ones the server still remembers)."""
        return await self._list(ProcessInfo, f"{self._base}/processes")

    async def process(self, pid: int) -> AsyncProcess:
        """A handle on an existing background process."""
        data = await self._client.json("GET", f"{self._base}/processes/{int(pid)}")
        return AsyncProcess(self._client, self._session_id, parse(ProcessInfo, data))

    async def connect(self, pid: int, *, stdout_from: int = 0, stderr_from: int = 0) -> AsyncProcess:
        """Reattach to a background process (e.g. from another client, after a disconnect): its
        :meth:`AsyncProcess.stream` and streaming ``wait`` start at these byte offsets (0: everything the
        sandbox still keeps)."""
        data = await self._client.json("GET", f"{self._base}/processes/{int(pid)}")
        return AsyncProcess(self._client, self._session_id, parse(ProcessInfo, data), stdout_from=stdout_from,
                            stderr_from=stderr_from)

"""Talking to running processes and watching files, without HTTP: what the routes (and other front ends,
such as a compatibility API) call.

- :func:`start_background`, :func:`send_stdin` / :func:`close_stdin`: a background process (started with
  ``open_stdin`` to take stdin);
- :func:`stream_output`: a background process's output from byte offsets until it exits (reattach by
  calling it again with the last offsets seen);
- :func:`watch_files`: changes under a directory of the sandbox;
- :func:`open_terminal`: a pseudo-terminal (:class:`capsa.common.terminal_wire.TerminalClient` to the node).

Each checks the tenant (another tenant's session is ``not_found``) and that the session runs. Streams and
terminals keep the session active while open (:func:`capsa.control.ports.access.keep_active`), so the idle
timeout does not cut them; closing them releases everything on the node and in the guest (the process
itself runs on, a terminal is hung up).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Generic, TypeVar

from capsa.common import node_api
from capsa.common.terminal_wire import TerminalClient, TerminalOptions
from capsa.common.wire.streams import FileEvent, OutputChunk, OutputEnd, StreamError
from capsa.control.nodes.calls import NodeLost, until_lost
from capsa.control.nodes.client import NodeClient
from capsa.control.plane import ControlPlane
from capsa.control.ports.access import keep_active
from capsa.control.sessions import relay
from capsa.sdk.models import ProcessInfo

__all__ = ["EventStream", "close_stdin", "open_terminal", "send_stdin", "start_background", "stream_output",
           "watch_files"]

_T = TypeVar("_T")


async def start_background(plane: ControlPlane, tenant: str, session_id: str, cmd: str | list[str], *,
                           env: dict[str, str] | None = None, cwd: str | None = None, user: str | None = None,
                           open_stdin: bool = False) -> ProcessInfo:
    """Start a background process (``open_stdin``: keep a pipe to its stdin for :func:`send_stdin`)."""
    target = await relay.running(plane, tenant, session_id)
    start = node_api.ProcessStart(cmd=cmd, env=env or {}, cwd=cwd, user=user, open_stdin=open_stdin)
    info = await relay.call(target, lambda node, sandbox: node.start_process(sandbox, start))
    return ProcessInfo.model_validate(info.model_dump())


async def send_stdin(plane: ControlPlane, tenant: str, session_id: str, pid: int, data: bytes) -> ProcessInfo:
    """Write ``data`` to the process's stdin: 409 ``stdin_closed`` (not started with ``open_stdin``, or
    closed) or ``process_exited``; 404 ``no_such_process``."""
    target = await relay.running(plane, tenant, session_id)
    info = await relay.call(target, lambda node, sandbox: node.send_stdin(sandbox, pid, data))
    return ProcessInfo.model_validate(info.model_dump())


async def close_stdin(plane: ControlPlane, tenant: str, session_id: str, pid: int) -> ProcessInfo:
    """Close the process's stdin (it reads EOF); closing twice is fine."""
    target = await relay.running(plane, tenant, session_id)
    info = await relay.call(target, lambda node, sandbox: node.close_stdin(sandbox, pid))
    return ProcessInfo.model_validate(info.model_dump())


class EventStream(Generic[_T]):
    """An open stream of events: iterate it once; ``aclose()`` (also at the end of iteration) releases
    the node's stream and stops keeping the session active."""

    def __init__(self, events: AsyncIterator[_T], stack: AsyncExitStack) -> None:
        self._events = events
        self._stack = stack

    async def __aiter__(self) -> AsyncIterator[_T]:
        try:
            async for event in self._events:
                yield event
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self._stack.aclose()


async def _open_stream(target: relay.SessionTarget,
                       opener: Callable[[NodeClient, str], AbstractAsyncContextManager[AsyncIterator[_T]]],
                       failed: Callable[[str, str], _T], *, active: bool = True) -> EventStream[_T]:
    """Open the node's stream (its refusal raises here), keep the session active while it is open
    (``active``), and pass its events on (they are the public API's: :mod:`capsa.common.wire.streams`);
    a sandbox lost mid-stream is recorded and reported as the last event."""
    node_events, stack = await relay.open_stream(target, opener)
    if active:
        try:
            await stack.enter_async_context(keep_active(target.plane, target.id))
        except BaseException:
            await stack.aclose()
            raise

    async def events() -> AsyncIterator[_T]:
        async for node_event in until_lost(node_events):
            if isinstance(node_event, NodeLost):
                yield failed("node_unreachable", f"lost the node while streaming: {node_event.message}")
                return
            if isinstance(node_event, StreamError) and node_event.code in relay.SANDBOX_GONE_CODES:
                yield failed(*await relay.sandbox_lost(target, node_event.code, node_event.detail))
                return
            yield node_event

    return EventStream(events(), stack)


def _stream_error(code: str, detail: str) -> StreamError:
    return StreamError(code=code, detail=detail)


async def stream_output(plane: ControlPlane, tenant: str, session_id: str, pid: int, *, stdout_from: int = 0,
                        stderr_from: int = 0) -> EventStream[OutputChunk | OutputEnd | StreamError]:
    """The process's output from the byte offsets until it exits: :class:`OutputChunk` events, then one
    :class:`OutputEnd` (or a :class:`StreamError`). Raises (``no_such_process`` ...) before streaming.
    Reattach after a disconnect with the last ``offset`` seen per channel: nothing is lost or repeated
    while the guest's ring buffer (the last 1 MiB per channel) still holds it; older bytes are reported
    as ``lost`` on the first chunk after the gap."""
    target = await relay.running(plane, tenant, session_id)
    return await _open_stream(target, lambda node, sandbox: node.stream_process(
        sandbox, pid, stdout_from=stdout_from, stderr_from=stderr_from), _stream_error)


async def watch_files(plane: ControlPlane, tenant: str, session_id: str, path: str, *,
                      recursive: bool = False, active: bool = True) -> EventStream[FileEvent | StreamError]:
    """Changes under the directory ``path`` until the stream is closed (or the directory is removed).
    Raises ``not_found``/``not_a_directory`` before streaming. ``active=False``: the open stream does not
    keep the session active (a watcher whose reader comes back by polling, whose polls are activity)."""
    target = await relay.running(plane, tenant, session_id)
    return await _open_stream(target, lambda node, sandbox: node.watch_dir(sandbox, path,
                                                                           recursive=recursive),
                              _stream_error, active=active)


async def open_terminal(plane: ControlPlane, tenant: str, session_id: str,
                        options: TerminalOptions) -> TerminalClient:
    """A pseudo-terminal in the session's sandbox (default command: the login shell). The caller relays
    it and closes it; keep the session active meanwhile with :func:`keep_active`."""
    target = await relay.running(plane, tenant, session_id)
    checked = options.check()
    return await relay.call(target, lambda node, sandbox: node.open_terminal(sandbox, checked))

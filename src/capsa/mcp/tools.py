"""capsa's MCP tools: sessions, commands and files, with the JSON schemas MCP clients see.

Every tool is a thin call into the public SDK. The client it uses comes from a :data:`ClientSource`
(stdio: one client for the process; HTTP: one per request, with that request's API key), so the API's
own authentication and tenant scoping decide what a tool may reach. Failures come back as MCP tool errors
(``is_error``) whose text starts with capsa's stable error code (``not_found: ...``); a failure to reach
the API is ``unreachable: ...``; the server itself keeps running.

Tools are grouped by what they act on (:data:`TOOL_GROUPS`). Computer-use actions (screenshot, click,
type, ...) belong in a group of their own once the API serves ``/v1/sessions/{id}/computer`` for
templates with a browser; until then no such tool exists.
"""

# Tool parameters named `timeout` are the API's remote deadlines, not asyncio timeouts.
# ruff: noqa: ASYNC109

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, Literal, Protocol, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

from capsa.common.egress_policy import EgressPolicy
from capsa.sdk import (
    AsyncClient,
    AsyncCommands,
    AsyncFiles,
    CapsaAPIError,
    CapsaClientError,
    CapsaConnectionError,
    CommandResult,
    FileInfo,
    SessionInfo,
)

__all__ = [
    "DEFAULT_READ_BYTES",
    "INSTRUCTIONS",
    "MAX_READ_BYTES",
    "MAX_WRITE_CHARS",
    "TOOL_GROUPS",
    "ClientSource",
    "CommandTools",
    "FileContent",
    "FileTools",
    "SessionTools",
    "ToolGroup",
    "build_server",
    "tool_error",
]

Ctx = Context[Any, Any]
T = TypeVar("T")
ClientSource = Callable[[Ctx], AbstractAsyncContextManager[AsyncClient]]
"""Gives the client a tool call uses, for the call's MCP context (the HTTP transport reads its headers)."""

DEFAULT_READ_BYTES = 1024 * 1024
MAX_READ_BYTES = 16 * 1024 * 1024
MAX_WRITE_CHARS = 16 * 1024 * 1024
"""file_write's content limit (over streamable HTTP the whole request is limited to 4 MiB by the
transport; larger files go through the REST files API)."""

INSTRUCTIONS = (
    "capsa runs each session in its own microVM. Create a session (session_create), then run shell "
    "commands (command_run) and read, write and list files (file_read, file_write, file_list) in it by its "
    "id. Close sessions you no longer need (session_close); pause keeps a snapshot to resume later. Errors "
    "start with a stable code such as not_found or invalid_state."
)

SessionId = Annotated[str, Field(description="The session id (ses_...) from session_create or session_list.",
                                 min_length=1, max_length=64)]
GuestPath = Annotated[str, Field(description="Absolute path inside the session's VM.", min_length=1,
                                 max_length=4096, pattern=r"^/[^\x00]*$")]


def tool_error(exc: CapsaClientError) -> ToolError:
    """The MCP tool error for an SDK failure: capsa's error code first, then the detail."""
    if isinstance(exc, CapsaAPIError):
        return ToolError(str(exc))
    if isinstance(exc, CapsaConnectionError):
        return ToolError(f"unreachable: {exc}")
    return ToolError(f"client_error: {exc}")


@contextlib.contextmanager
def _as_tool_errors() -> Iterator[None]:
    try:
        yield
    except CapsaClientError as exc:
        raise tool_error(exc) from exc


class FileContent(BaseModel):
    """What ``file_read`` answers."""

    path: str
    encoding: Literal["utf-8", "base64"]
    """``utf-8`` when the bytes read are valid UTF-8 text, else ``base64``."""
    content: str
    size: int
    """How many bytes were read (at most ``max_bytes``)."""
    truncated: bool
    """True when the file has more bytes than were read."""


class ToolGroup(Protocol):
    def register(self, server: MCPServer[Any]) -> None: ...


_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


class _Tools:
    """Tools that call the API as the MCP caller: a client from ``clients`` for each call, SDK failures
    raised as tool errors."""

    def __init__(self, clients: ClientSource) -> None:
        self._clients = clients

    async def _call(self, ctx: Ctx, op: Callable[[AsyncClient], Awaitable[T]]) -> T:
        async with self._clients(ctx) as client:
            with _as_tool_errors():
                return await op(client)


class SessionTools(_Tools):
    """Create, list, inspect, close, pause, resume and branch sessions."""

    def register(self, server: MCPServer[Any]) -> None:
        server.add_tool(self.session_create, annotations=_WRITES)
        server.add_tool(self.session_list, annotations=_READ_ONLY)
        server.add_tool(self.session_get, annotations=_READ_ONLY)
        server.add_tool(self.session_close, annotations=_DESTROYS)
        server.add_tool(self.session_pause, annotations=_WRITES)
        server.add_tool(self.session_resume, annotations=_WRITES)
        server.add_tool(self.session_branch, annotations=_WRITES)

    async def session_create(
        self, ctx: Ctx,
        template: Annotated[str, Field(description="Template to start from.", min_length=1,
                                       max_length=64)] = "base",
        timeout: Annotated[int | None, Field(description="Hard lifetime in seconds (server default if "
                                             "omitted).", ge=1, le=7 * 86400)] = None,
        idle_timeout: Annotated[int | None, Field(description="Close after this many idle seconds.",
                                                  ge=1, le=7 * 86400)] = None,
        memory_mib: Annotated[int | None, Field(description="Guest memory in MiB.", ge=64,
                                                le=256 * 1024)] = None,
        vcpus: Annotated[int | None, Field(description="Guest vCPUs.", ge=1, le=64)] = None,
        env: Annotated[dict[str, str] | None, Field(description="Environment for every command.")] = None,
        metadata: Annotated[dict[str, str] | None,
                            Field(description="Labels to find the session by.")] = None,
        policy: Annotated[EgressPolicy | None, Field(
            description="Network access: the domains the session may reach over HTTP(S), e.g. "
                        '{"domains": [{"domain": "pypi.org"}, {"domain": "*.pythonhosted.org"}]}. '
                        "Without a policy the session has no network at all.")] = None,
    ) -> SessionInfo:
        """Start a new session: a fresh microVM from the template. Returns the session, with its id."""
        document = None if policy is None else policy.model_dump(mode="json", exclude_defaults=True)
        return await self._call(ctx, lambda client: client.create_session(
            template=template, timeout=timeout, idle_timeout=idle_timeout, memory_mib=memory_mib, vcpus=vcpus,
            env=env, metadata=metadata, policy=document))

    async def session_list(
        self, ctx: Ctx,
        state: Annotated[Literal["creating", "running", "recovering", "paused", "closed", "failed"] | None,
                         Field(description="Only sessions in this state.")] = None,
        limit: Annotated[int, Field(description="At most this many, newest first.", ge=1, le=500)] = 50,
    ) -> list[SessionInfo]:
        """List this API key's sessions, newest first."""
        return await self._call(ctx, lambda client: client.list_sessions(state=state, limit=limit))

    async def session_get(self, ctx: Ctx, session_id: SessionId) -> SessionInfo:
        """One session's current state."""
        return await self._call(ctx, lambda client: client.get_session(session_id))

    async def session_close(self, ctx: Ctx, session_id: SessionId) -> SessionInfo:
        """Close a session: its VM is destroyed, and its files with it."""
        return await self._call(ctx, lambda client: client.close_session(session_id))

    async def session_pause(self, ctx: Ctx, session_id: SessionId) -> SessionInfo:
        """Snapshot a running session and stop its VM; session_resume continues exactly where it was."""
        return await self._call(ctx, lambda client: client.pause_session(session_id))

    async def session_resume(self, ctx: Ctx, session_id: SessionId) -> SessionInfo:
        """Resume a paused session from its snapshot (processes, files and memory as they were)."""
        return await self._call(ctx, lambda client: client.resume_session(session_id))

    async def session_branch(
        self, ctx: Ctx, session_id: SessionId,
        n: Annotated[int, Field(description="How many branches.", ge=1, le=64)] = 1,
    ) -> list[SessionInfo]:
        """Make n new independent sessions, each starting from this session's current state."""
        return await self._call(ctx, lambda client: client.branch_session(session_id, n))


class CommandTools(_Tools):
    """Run commands in a session."""

    def register(self, server: MCPServer[Any]) -> None:
        server.add_tool(self.command_run, annotations=_DESTROYS)

    async def command_run(
        self, ctx: Ctx, session_id: SessionId,
        command: Annotated[str, Field(description="A shell command line (run by /bin/sh -c).", min_length=1,
                                      max_length=131072)],
        timeout: Annotated[float, Field(description="Seconds before the command is killed.", gt=0,
                                        le=86400)] = 60.0,
        cwd: Annotated[str | None, Field(description="Working directory (absolute).", max_length=4096,
                                         pattern=r"^/[^\x00]*$")] = None,
        env: Annotated[dict[str, str] | None, Field(description="Extra environment variables.")] = None,
        stdin: Annotated[str | None, Field(description="Text fed to the command's standard input.",
                                           max_length=16 * 1024 * 1024)] = None,
    ) -> CommandResult:
        """Run a command in the session and wait for it. A non-zero exit code or a timeout (timed_out) is
        a normal result; stdout and stderr come back separately."""
        return await self._call(ctx, lambda client: AsyncCommands(client, session_id).run(
            command, timeout=timeout, cwd=cwd, env=env, stdin=stdin))


class FileTools(_Tools):
    """Read, write and list files in a session."""

    def register(self, server: MCPServer[Any]) -> None:
        server.add_tool(self.file_read, annotations=_READ_ONLY)
        server.add_tool(self.file_write, annotations=_WRITES)
        server.add_tool(self.file_list, annotations=_READ_ONLY)

    async def file_read(
        self, ctx: Ctx, session_id: SessionId, path: GuestPath,
        max_bytes: Annotated[int, Field(description="Read at most this many bytes.", ge=1,
                                        le=MAX_READ_BYTES)] = DEFAULT_READ_BYTES,
    ) -> FileContent:
        """Read a file: UTF-8 text as it is, anything else base64-encoded."""
        data, truncated = await self._call(
            ctx, lambda client: _read_prefix(AsyncFiles(client, session_id), path, max_bytes))
        try:
            return FileContent(path=path, encoding="utf-8", content=data.decode("utf-8"), size=len(data),
                               truncated=truncated)
        except UnicodeDecodeError:
            return FileContent(path=path, encoding="base64", content=base64.b64encode(data).decode("ascii"),
                               size=len(data), truncated=truncated)

    async def file_write(
        self, ctx: Ctx, session_id: SessionId, path: GuestPath,
        content: Annotated[str, Field(description="The new content of the file.",
                                      max_length=MAX_WRITE_CHARS)],
        encoding: Annotated[Literal["utf-8", "base64"],
                            Field(description="How content is encoded.")] = "utf-8",
        mode: Annotated[str | None, Field(description="Permission bits in octal, e.g. 755.",
                                          pattern=r"^[0-7]{3,4}$")] = None,
    ) -> FileInfo:
        """Create or replace a file (parent directories are created)."""
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise ToolError("validation_error: content is not valid base64") from None
        else:
            data = content.encode("utf-8")
        return await self._call(ctx, lambda client: AsyncFiles(client, session_id).write(
            path, data, mode=None if mode is None else int(mode, 8)))

    async def file_list(self, ctx: Ctx, session_id: SessionId, path: GuestPath) -> list[FileInfo]:
        """List a directory's entries."""
        return await self._call(ctx, lambda client: AsyncFiles(client, session_id).list(path))


async def _read_prefix(files: AsyncFiles, path: str, limit: int) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of ``path``, and whether there was more (the stream stops there)."""
    parts: list[bytes] = []
    size = 0
    chunks = files.iter_bytes(path)
    try:
        async for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                data = b"".join(parts)
                return data[:limit], True
    finally:
        if isinstance(chunks, AsyncGenerator):
            await chunks.aclose()
    return b"".join(parts), False


TOOL_GROUPS: tuple[Callable[[ClientSource], ToolGroup], ...] = (SessionTools, CommandTools, FileTools)
"""The groups every capsa MCP server offers, in listing order."""


@contextlib.contextmanager
def _logging_left_alone() -> Iterator[None]:
    """``MCPServer()`` calls ``logging.basicConfig`` (a rich handler at INFO on the root logger) when the
    root logger has no handler yet; the process's logging belongs to the program (``capsa serve``,
    ``capsa mcp``), so give the root a placeholder handler for that moment."""
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)


def build_server(clients: ClientSource, *, name: str = "capsa", version: str = "") -> MCPServer[Any]:
    """An MCP server with every group of :data:`TOOL_GROUPS`; its tools get their client from ``clients``."""
    with _logging_left_alone():
        server: MCPServer[Any] = MCPServer(name, instructions=INSTRUCTIONS, version=version)
    for group in TOOL_GROUPS:
        group(clients).register(server)
    return server

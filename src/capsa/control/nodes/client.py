"""HTTP client for the node agent API (spec/node.openapi.json), used by the control plane only.

A node URL is ``http(s)://host:port`` or ``unix:///path/to/socket``. Every call carries the node's token.
Failures become :class:`NodeError` with the node's stable error code, or ``node_unreachable``.

A node in the same process (``capsa serve``'s) is reached through the same client with its ASGI app
(``NodeClient(url, token, app=node_app)``): calls with a whole answer (a command run to its end, a sandbox
creation, every other unary call) go to the app in-process, through the node API's own routes, models,
codes and statuses, without the socket's serializing, parsing and HTTP round trip; streamed answers
(httpx's ``ASGITransport`` reads an answer to its end before returning it) and WebSockets still go over
``url``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp

from capsa.common import logs
from capsa.common.errors import CapsaError
from capsa.common.node_api import (
    EXEC_EVENT,
    NDJSON,
    ApprovalDecision,
    ApprovalInfo,
    ApprovalList,
    AuditPage,
    BranchRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    FileList,
    KillRequest,
    NodeInfo,
    PauseRequest,
    PolicyUpdated,
    ProcessInfo,
    ProcessList,
    ProcessOutput,
    ProcessStart,
    RestoreRequest,
    SandboxInfo,
    SandboxList,
    SnapshotCreate,
    SnapshotInfo,
)
from capsa.common.port_tunnel import PortTunnel, open_tunnel
from capsa.common.terminal_wire import TerminalClient, TerminalOptions
from capsa.common.websocket import SocketStream
from capsa.common.wire.streams import OUTPUT_EVENT, WATCH_EVENT, OutputEvent, WatchEvent
from capsa.control.audit import trail as audit_trail

__all__ = ["EgressArgs", "NodeClient", "NodeClientPool", "NodeError"]

_PREFIX = "/node/v1"
_STREAMED = "capsa_streamed"
"""A request extension: the answer is read as a stream (over the network even for an in-process node)."""
_TUNNEL_OPEN_TIMEOUT = 60.0
_M = TypeVar("_M", bound=BaseModel)
_W = TypeVar("_W")


@dataclass(frozen=True)
class EgressArgs:
    """A session's egress as a sandbox start sends it to the node: the policy (secret references by id),
    the values of the secrets it binds and the session's placeholders (secret id -> placeholder)."""

    policy: Mapping[str, Any]
    secrets: Mapping[str, str]
    placeholders: Mapping[str, str]
    session_id: str
    networks: Sequence[str] = ()
    """The internal networks the session's tenant was granted (capsa.control.egress.grants)."""

    def body(self) -> dict[str, Any]:
        # A plain dict, not the pydantic request: the secrets' values must go over the wire, not their mask.
        return {"session_id": self.session_id, "policy": dict(self.policy), "secrets": dict(self.secrets),
                "placeholders": dict(self.placeholders), "granted_networks": list(self.networks)}


class NodeError(CapsaError):
    """A node answered with an error, or could not be reached (``node_unreachable``)."""

    def __init__(self, code: str, status: int, detail: str) -> None:
        super().__init__(detail, code=code, status=status)


def _raise_for(response: httpx.Response, body: bytes | None = None) -> None:
    if response.is_success:
        return
    raw = body if body is not None else response.content
    try:
        problem = json.loads(raw)
        code = str(problem.get("code", "node_error"))
        detail = str(problem.get("detail", ""))
    except (ValueError, AttributeError):
        code, detail = "node_error", raw[:200].decode(errors="replace")
    raise NodeError(code, response.status_code, detail)


def _parse(model: type[_M], raw: bytes) -> _M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise NodeError("bad_node_answer", 502, f"the node sent a {model.__name__} that does not parse: "
                                                f"{exc.error_count()} error(s)") from exc


def _unreachable(exc: httpx.TransportError) -> NodeError:
    if isinstance(exc, httpx.TimeoutException):
        return NodeError("node_unreachable", 503, f"node timed out: {type(exc).__name__}")
    return NodeError("node_unreachable", 503, f"node unreachable: {exc}")


async def _carry_request_id(request: httpx.Request) -> None:
    """Node calls made for an API request carry its id (``X-Request-Id``), for node-side events it causes
    (:attr:`capsa.node.egress.audit.EgressEvent.request_id`) and the node's log lines, and the id of the
    session the request looked up (``X-Capsa-Session-Id``, see :mod:`capsa.common.logs`)."""
    context = audit_trail.current()
    if context is not None:
        request.headers[logs.REQUEST_ID_HEADER] = context.request_id
    session_id = logs.context_value("session_id")
    if isinstance(session_id, str):
        request.headers[logs.SESSION_ID_HEADER] = session_id


class _InProcess(httpx.AsyncBaseTransport):
    """Whole answers from the node's ASGI app in this process, streamed ones over ``network``."""

    def __init__(self, app: ASGIApp, network: httpx.AsyncBaseTransport) -> None:
        # raise_app_exceptions=False: an unexpected error answers 500 ``internal_error``, as over HTTP.
        self._app = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self._network = network

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.extensions.get(_STREAMED):
            return await self._network.handle_async_request(request)
        # The client's read timeout bounds the call as it would over HTTP (None: unbounded).
        read = request.extensions.get("timeout", {}).get("read")
        try:
            async with asyncio.timeout(read):
                return await self._app.handle_async_request(request)
        except TimeoutError:
            raise httpx.ReadTimeout("the in-process node did not answer in time", request=request) from None

    async def aclose(self) -> None:
        await self._network.aclose()


class NodeClient:
    """One node's API. ``transport`` replaces the network (e.g. ``httpx.ASGITransport(app=node_app)``);
    ``app``: the node's ASGI app when the node runs in this process (see the module's docstring)."""

    def __init__(self, url: str, token: str, *, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None, app: ASGIApp | None = None) -> None:
        self._url = url
        self._token = token
        if url.startswith("unix://"):
            transport = transport or httpx.AsyncHTTPTransport(uds=url.removeprefix("unix://"))
            base = "http://node"
        else:
            transport = transport or httpx.AsyncHTTPTransport()
            base = url.rstrip("/")
        if app is not None:
            transport = _InProcess(app, transport)
        self._client = httpx.AsyncClient(
            transport=transport, base_url=base + _PREFIX, timeout=httpx.Timeout(timeout, connect=5.0),
            headers={"Authorization": f"Bearer {token}"}, event_hooks={"request": [_carry_request_id]},
        )

    @property
    def url(self) -> str:
        return self._url

    @property
    def token(self) -> str:
        return self._token

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        _raise_for(response)
        return response

    async def _call(self, model: type[_M], method: str, path: str, **kwargs: Any) -> _M:
        return _parse(model, (await self._request(method, path, **kwargs)).content)

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        try:
            async with self._client.stream(method, path, extensions={_STREAMED: True}, **kwargs) as response:
                if not response.is_success:
                    _raise_for(response, await response.aread())
                yield response
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc

    # -- node ------------------------------------------------------------------------------------------
    async def info(self) -> NodeInfo:
        return await self._call(NodeInfo, "GET", "/info")

    # -- sandboxes -------------------------------------------------------------------------------------
    @staticmethod
    def create_body(sandbox_id: str, template: str, memory_mib: int, vcpus: int, env: Mapping[str, str], *,
                    egress: EgressArgs | None = None, tenant: str | None = None) -> dict[str, Any]:
        """The body of ``POST /sandboxes`` (:class:`~capsa.common.node_api.SandboxCreate` as JSON)."""
        body: dict[str, Any] = {"id": sandbox_id, "template": template, "memory_mib": memory_mib,
                                "vcpus": vcpus, "env": dict(env)}
        if tenant is not None:
            body["tenant"] = tenant
        if egress is not None:
            body.update(egress.body())
        return body

    async def create_sandbox(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                             env: Mapping[str, str], *, egress: EgressArgs | None = None,
                             tenant: str | None = None) -> SandboxInfo:
        body = self.create_body(sandbox_id, template, memory_mib, vcpus, env, egress=egress, tenant=tenant)
        return await self._call(SandboxInfo, "POST", "/sandboxes", json=body, timeout=None)

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        await self._request("DELETE", f"/sandboxes/{sandbox_id}")

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return (await self._call(SandboxList, "GET", "/sandboxes")).items

    # -- egress ----------------------------------------------------------------------------------------
    async def update_policy(self, sandbox_id: str, policy: Mapping[str, Any], secrets: Mapping[str, str],
                            placeholders: Mapping[str, str] | None = None,
                            networks: Sequence[str] | None = None) -> PolicyUpdated:
        """``networks``: the tenant's granted internal networks (None: the sandbox keeps its own)."""
        body: dict[str, Any] = {"policy": dict(policy), "secrets": dict(secrets),
                                "placeholders": dict(placeholders or {})}
        if networks is not None:
            body["granted_networks"] = list(networks)
        return await self._call(PolicyUpdated, "PUT", f"/sandboxes/{sandbox_id}/policy", json=body)

    async def list_approvals(self, session_ids: list[str], *, include_decided: bool = False) -> ApprovalList:
        params: list[tuple[str, str]] = [("session", sid) for sid in session_ids]
        if include_decided:
            params.append(("include_decided", "true"))
        return await self._call(ApprovalList, "GET", "/approvals", params=params)

    async def get_approval(self, approval_id: str) -> ApprovalInfo:
        return await self._call(ApprovalInfo, "GET", f"/approvals/{approval_id}")

    async def decide_approval(self, approval_id: str, decision: ApprovalDecision) -> ApprovalInfo:
        return await self._call(ApprovalInfo, "POST", f"/approvals/{approval_id}/decision",
                                json=decision.model_dump(mode="json"))
    async def revoke_connection(self, connection_id: str) -> None:
        """Stop injecting the connection's token into any request on this node, at once."""
        await self._request("POST", f"/connections/{connection_id}/revoke")

    async def audit(self, *, after: int, epoch: str | None, limit: int) -> AuditPage:
        params: dict[str, str | int] = {"after": after, "limit": limit}
        if epoch is not None:
            params["epoch"] = epoch
        return await self._call(AuditPage, "GET", "/audit", params=params)

    # -- snapshots (docs/node-snapshots.md) ------------------------------------------------------------
    async def snapshot_sandbox(self, sandbox_id: str, *, retain: bool = True,
                               labels: Mapping[str, str] | None = None, tenant: str | None = None
                               ) -> SnapshotInfo:
        """``tenant``: whose snapshot it is (the scope of its data in the fleet's store)."""
        body = SnapshotCreate(retain=retain, labels=dict(labels or {}), tenant=tenant)
        return await self._call(SnapshotInfo, "POST", f"/sandboxes/{sandbox_id}/snapshots",
                                json=body.model_dump(mode="json"), timeout=None)

    async def pause_sandbox(self, sandbox_id: str, *,
                            labels: Mapping[str, str] | None = None, tenant: str | None = None
                            ) -> SnapshotInfo:
        body = PauseRequest(labels=dict(labels or {}), tenant=tenant)
        return await self._call(SnapshotInfo, "POST", f"/sandboxes/{sandbox_id}/pause",
                                json=body.model_dump(mode="json"), timeout=None)

    async def restore_snapshot(self, snapshot_id: str, sandbox_id: str, env: Mapping[str, str], *,
                               egress: EgressArgs | None = None) -> SandboxInfo:
        """``egress``: the session's (required for a snapshot of a sandbox with a policy)."""
        body: dict[str, Any] = RestoreRequest(id=sandbox_id, env=dict(env)).model_dump(mode="json",
                                                                                      exclude_none=True)
        if egress is not None:
            body.update(egress.body())
        return await self._call(SandboxInfo, "POST", f"/snapshots/{snapshot_id}/restore", json=body,
                                timeout=None)

    async def branch_snapshot(self, snapshot_id: str, sandbox_ids: list[str], env: Mapping[str, str], *,
                              egress: list[EgressArgs] | None = None) -> list[SandboxInfo]:
        """``egress``: one per id (each branch's session and copy of the policy)."""
        body: dict[str, Any] = BranchRequest(ids=sandbox_ids, env=dict(env)).model_dump(mode="json",
                                                                                       exclude_none=True)
        if egress is not None:
            body["egress"] = [e.body() for e in egress]
        return (await self._call(SandboxList, "POST", f"/snapshots/{snapshot_id}/branch", json=body,
                                 timeout=None)).items

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._request("DELETE", f"/snapshots/{snapshot_id}")

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self._call(SnapshotInfo, "GET", f"/snapshots/{snapshot_id}")

    # -- commands --------------------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        # The command's own timeout bounds this call; the node returns once the guest reports.
        return await self._call(ExecResult, "POST", f"/sandboxes/{sandbox_id}/exec",
                                json=request.model_dump(mode="json"), timeout=None)

    @asynccontextmanager
    async def exec_stream(self, sandbox_id: str,
                          request: ExecRequest) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """Yields the command's events (output, then one result or error), once the node accepted it."""
        async with self._stream("POST", f"/sandboxes/{sandbox_id}/exec", json=request.model_dump(mode="json"),
                                timeout=None, headers={"Accept": NDJSON}) as response:
            yield _lines_of(response.aiter_lines(), EXEC_EVENT, "an exec event")

    async def start_process(self, sandbox_id: str, request: ProcessStart) -> ProcessInfo:
        return await self._call(ProcessInfo, "POST", f"/sandboxes/{sandbox_id}/processes",
                                json=request.model_dump(mode="json"))

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return (await self._call(ProcessList, "GET", f"/sandboxes/{sandbox_id}/processes")).items

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return await self._call(ProcessInfo, "GET", f"/sandboxes/{sandbox_id}/processes/{pid}")

    async def process_output(self, sandbox_id: str, pid: int) -> ProcessOutput:
        return await self._call(ProcessOutput, "GET", f"/sandboxes/{sandbox_id}/processes/{pid}/output")

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes) -> ProcessInfo:
        return await self._call(ProcessInfo, "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/stdin",
                                content=data, headers={"Content-Type": "application/octet-stream"},
                                timeout=None)

    async def close_stdin(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return await self._call(ProcessInfo, "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/stdin/close")

    @asynccontextmanager
    async def stream_process(self, sandbox_id: str, pid: int, *, stdout_from: int = 0,
                             stderr_from: int = 0) -> AsyncIterator[AsyncIterator[OutputEvent]]:
        """Yields the process's output events from the offsets (then one ``exit`` or ``error``), once the
        node accepted the request (an unknown process raises NodeError here)."""
        params = {"stdout_from": stdout_from, "stderr_from": stderr_from}
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/processes/{pid}/stream", params=params,
                                timeout=None) as response:
            yield _lines_of(response.aiter_lines(), OUTPUT_EVENT, "a process output event")

    @asynccontextmanager
    async def watch_dir(self, sandbox_id: str, path: str, *,
                        recursive: bool = False) -> AsyncIterator[AsyncIterator[WatchEvent]]:
        """Yields the directory's change events until the caller leaves the block."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/files/watch", params=params,
                                timeout=None) as response:
            yield _lines_of(response.aiter_lines(), WATCH_EVENT, "a watch event")

    async def kill_process(self, sandbox_id: str, pid: int, signal: int) -> ProcessInfo:
        return await self._call(ProcessInfo, "POST", f"/sandboxes/{sandbox_id}/processes/{pid}/kill",
                                json=KillRequest(signal=signal).model_dump(mode="json"))

    # -- ports ---------------------------------------------------------------------------------------
    async def open_port(self, sandbox_id: str, port: int) -> PortTunnel:
        """A raw TCP connection to ``port`` inside the sandbox (the node's port tunnel, a WebSocket on the
        node's own socket: httpx cannot hand over an upgraded connection). Refusals raise NodeError with the
        node's code (``port_unreachable``, ``sandbox_not_found`` ...)."""
        target = f"{_PREFIX}/sandboxes/{sandbox_id}/ports/{port}/tunnel"
        # The node answers once the guest connected (or refused): its connect timeout plus slack.
        return await self._websocket("the port tunnel", lambda stream, host: open_tunnel(
            stream, host, target, headers=self._auth()))

    async def open_terminal(self, sandbox_id: str, options: TerminalOptions) -> TerminalClient:
        """A pseudo-terminal in the sandbox (the node's ``/pty`` WebSocket, protocol
        :mod:`capsa.common.terminal_wire`). Refusals raise NodeError with the node's code."""
        target = f"{_PREFIX}/sandboxes/{sandbox_id}/pty?{options.query()}"
        return await self._websocket("the terminal", lambda stream, host: TerminalClient.connect(
            stream, host, target, headers=self._auth()))

    async def _websocket(self, what: str, connect: Callable[[SocketStream, str], Awaitable[_W]]) -> _W:
        """``connect`` on a connection of its own to the node (httpx cannot hand over an upgraded one),
        within the open timeout; refusals raise NodeError with the node's code, failures
        ``node_unreachable``."""
        try:
            stream, host = await self._socket()
            async with asyncio.timeout(_TUNNEL_OPEN_TIMEOUT):
                return await connect(stream, host)
        except CapsaError as exc:
            raise NodeError(exc.code, exc.status, exc.message) from None
        except TimeoutError:
            raise NodeError("node_unreachable", 503, f"the node did not open {what} within "
                                                     f"{_TUNNEL_OPEN_TIMEOUT:g} s") from None
        except (OSError, ConnectionError) as exc:
            raise NodeError("node_unreachable", 503, f"node unreachable: {exc}") from None

    def _auth(self) -> list[tuple[str, str]]:
        return [("Authorization", f"Bearer {self._token}")]

    async def _socket(self) -> tuple[SocketStream, str]:
        """A connection of its own to the node, for a WebSocket (httpx cannot hand one over), and the Host."""
        if self._url.startswith("unix://"):
            return await SocketStream.connect_unix(self._url.removeprefix("unix://")), "node"
        parts = urlsplit(self._url)
        tls = parts.scheme == "https"
        stream = await SocketStream.connect(parts.hostname or "localhost", parts.port or (443 if tls else 80),
                                            tls=tls)
        return stream, parts.netloc

    # -- files -----------------------------------------------------------------------------------------
    @asynccontextmanager
    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/files/content", params={"path": path},
                                timeout=None) as response:
            yield response.aiter_raw()

    async def write_file(self, sandbox_id: str, path: str, mode: int | None,
                         body: AsyncIterable[bytes]) -> FileInfo:
        params: dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        return await self._call(FileInfo, "PUT", f"/sandboxes/{sandbox_id}/files/content", params=params,
                                content=body, timeout=None)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileInfo]:
        return (await self._call(FileList, "GET", f"/sandboxes/{sandbox_id}/files/list",
                                 params={"path": path})).items

    async def stat(self, sandbox_id: str, path: str) -> FileInfo:
        return await self._call(FileInfo, "GET", f"/sandboxes/{sandbox_id}/files/stat", params={"path": path})

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> FileInfo:
        return await self._call(FileInfo, "POST", f"/sandboxes/{sandbox_id}/files/mkdir",
                                params={"path": path, "parents": "true" if parents else "false"})

    async def rename(self, sandbox_id: str, path: str, to: str) -> FileInfo:
        return await self._call(FileInfo, "POST", f"/sandboxes/{sandbox_id}/files/rename",
                                params={"path": path, "to": to})

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._request("DELETE", f"/sandboxes/{sandbox_id}/files",
                            params={"path": path, "recursive": "true" if recursive else "false"})

    @asynccontextmanager
    async def export_archive(self, sandbox_id: str, path: str) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/files/archive", params={"path": path},
                                timeout=None) as response:
            yield response.aiter_raw()

    async def import_archive(self, sandbox_id: str, path: str, body: AsyncIterable[bytes]) -> None:
        await self._request("PUT", f"/sandboxes/{sandbox_id}/files/archive", params={"path": path},
                            content=body, timeout=None)


_E = TypeVar("_E")


async def _lines_of(lines: AsyncIterator[str], adapter: TypeAdapter[_E], what: str) -> AsyncIterator[_E]:
    async for line in lines:
        if not line:
            continue
        try:
            yield adapter.validate_json(line)
        except ValidationError as exc:
            raise NodeError("bad_node_answer", 502, f"the node sent {what} that does not parse: "
                                                    f"{exc.error_count()} error(s)") from exc


class NodeClientPool:
    """Keeps one connection pool per node; a cache only, nothing another replica would need."""

    def __init__(self, timeout: float = 120.0, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._timeout = timeout
        self._transport = transport
        self._clients: dict[tuple[str, str], NodeClient] = {}
        self._retired: list[NodeClient] = []

    def add(self, client: NodeClient) -> None:
        """Use ``client`` for its node (``capsa serve``: its own node, with its app in-process)."""
        replaced = self._clients.get((client.url, client.token))
        if replaced is not None:
            self._retired.append(replaced)  # closed with the pool: a call may still be using it
        self._clients[(client.url, client.token)] = client

    def get(self, url: str, token: str) -> NodeClient:
        key = (url, token)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = NodeClient(url, token, timeout=self._timeout,
                                                         transport=self._transport)
        return client

    async def aclose(self) -> None:
        clients, self._clients = [*self._clients.values(), *self._retired], {}
        self._retired = []
        for client in clients:
            await client.aclose()

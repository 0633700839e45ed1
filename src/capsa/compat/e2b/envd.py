"""The in-sandbox daemon protocol (envd) the E2B SDK speaks, served by the control plane.

The SDK configured with ``E2B_SANDBOX_URL`` sends every envd request to that one URL with the sandbox in
``E2b-Sandbox-Id`` (and ``E2b-Sandbox-Port: 49983``), authenticated by ``X-Access-Token``; capsa serves
that URL at ``/e2b/envd``: Connect RPC (JSON) for ``process.Process`` and ``filesystem.Filesystem``,
``GET``/``POST /files`` and ``/health``. Each call is parsed here and becomes calls on the session's node
(``NodeClient``), which reach the guest over capsa's own channel: nothing E2B-specific runs in the VM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from capsa.common import node_api
from capsa.compat.e2b import filesystem, multipart, process, watch
from capsa.compat.e2b.access import EnvdTarget, envd_target, plane
from capsa.compat.e2b.connect import (
    ConnectError,
    as_connect,
    error_response,
    read_message,
    read_messages,
    single_message_stream,
    stream_response,
    unary_response,
)
from capsa.control.audit.digest import StreamDigest
from capsa.control.errors import ApiError, PayloadTooLarge
from capsa.control.plane import ControlPlane
from capsa.control.sessions import relay

__all__ = ["MULTIPART", "Call", "Live", "live_state", "router"]

router = APIRouter()

MULTIPART = importlib.util.find_spec("python_multipart") is not None
"""Whether multipart uploads can be parsed here (the ``capsa[e2b]`` extra)."""
_STREAMS = {"process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir",
            "process.Process/StreamInput"}


def _user(request: Request) -> str | None:
    return process.user_from_authorization(request.headers.get("authorization"))


def _path(message: dict[str, Any], user: str | None, key: str = "path") -> str:
    return filesystem.resolve_path(message.get(key), user)


@dataclass
class Call:
    """One parsed envd call: the plane, this replica's terminals and watchers, the target session, the
    request message and the user the SDK named."""

    control: ControlPlane
    live: Live
    target: EnvdTarget
    message: dict[str, Any]
    user: str | None

    def path(self, key: str = "path") -> str:
        return _path(self.message, self.user, key)


@dataclass
class Live:
    """What this replica holds open for E2B clients (terminals, polled watchers)."""

    terminals: process.Terminals = field(default_factory=process.Terminals)
    watchers: watch.Watchers = field(default_factory=watch.Watchers)


async def _create_watcher(c: Call) -> dict[str, Any]:
    recursive = c.message.get("recursive") is True
    watcher_id = await c.live.watchers.create(c.control, c.target, c.path(), recursive)
    return {"watcherId": watcher_id}


async def _watcher_events(c: Call) -> dict[str, Any]:
    return {"events": c.live.watchers.drain(c.target, c.message.get("watcherId"))}


async def _remove_watcher(c: Call) -> dict[str, Any]:
    await c.live.watchers.remove(c.target, c.message.get("watcherId"))
    return {}


_UNARY: dict[str, Callable[[Call], Awaitable[dict[str, Any]]]] = {
    "process.Process/List": lambda c: process.list_processes(c.control, c.live.terminals, c.target),
    "process.Process/SendSignal": lambda c: process.send_signal(c.control, c.live.terminals, c.target,
                                                                c.message),
    "process.Process/SendInput": lambda c: process.send_input(c.control, c.live.terminals, c.target,
                                                              c.message),
    "process.Process/CloseStdin": lambda c: process.close_stdin(c.control, c.target, c.message),
    "process.Process/Update": lambda c: process.update_process(c.live.terminals, c.target, c.message),
    "filesystem.Filesystem/Stat": lambda c: filesystem.stat(c.control, c.target, c.path()),
    "filesystem.Filesystem/MakeDir": lambda c: filesystem.make_dir(c.control, c.target, c.path()),
    "filesystem.Filesystem/Move": lambda c: filesystem.move(c.control, c.target, c.path("source"),
                                                             c.path("destination")),
    "filesystem.Filesystem/ListDir": lambda c: filesystem.list_dir(c.control, c.target, c.path(),
                                                                    c.message.get("depth")),
    "filesystem.Filesystem/Remove": lambda c: filesystem.remove(c.control, c.target, c.path()),
    "filesystem.Filesystem/CreateWatcher": _create_watcher,
    "filesystem.Filesystem/GetWatcherEvents": _watcher_events,
    "filesystem.Filesystem/RemoveWatcher": _remove_watcher,
}


def _stream(c: Call, name: str, request: Request) -> AsyncIterator[Mapping[str, Any]]:
    if name == "filesystem.Filesystem/WatchDir":
        return watch.watch_stream(c.control, c.target, c.path(), c.message.get("recursive") is True)
    start = process.start_request(c.message, c.user) if name == "process.Process/Start" else None
    return process.stream_process(c.control, c.live.terminals, c.target, c.message, start=start,
                                  timeout_ms=request.headers.get("connect-timeout-ms"))


def live_state(request: Request) -> Live:
    live = request.app.state.e2b_live
    assert isinstance(live, Live)
    return live


async def _stream_input(request: Request) -> Response:
    """``StreamInput`` (client stream): a ``start`` naming the process, then ``data`` inputs, until the
    client ends its request body; answered with one empty message."""
    control, live = plane(request), live_state(request)
    target = await envd_target(request)
    pid: int | None = None
    async for message in read_messages(request):
        if "start" in message:
            pid = process.selected_pid(message["start"] or {})
        elif "data" in message:
            if pid is None:
                raise ConnectError("invalid_argument", "StreamInput needs a start message first")
            await process.send_input(control, live.terminals, target,
                                     {"process": {"pid": pid}, **(message["data"] or {})})
    return single_message_stream({})


async def _rpc(service: str, method: str, request: Request) -> Response:
    name = f"{service}/{method}"
    streaming = name in _STREAMS or (request.headers.get("content-type") or "").startswith(
        "application/connect+")
    try:
        if name == "process.Process/StreamInput":
            return await _stream_input(request)
        if name not in _UNARY and name not in _STREAMS:
            raise ConnectError("unimplemented", f"unknown method {name}")
        message = await read_message(request)
        call = Call(plane(request), live_state(request), await envd_target(request), message, _user(request))
        if name in _UNARY:
            return unary_response(await _UNARY[name](call))
        if name == "process.Process/Start":  # a command, as on /v1: counted against the key's rate limit
            settings = call.control.settings
            await call.control.rates.hit(call.control.db, call.target.principal.key_id, "commands",
                                         settings.command_limit, settings.rate_window_seconds)
        return stream_response(_stream(call, name, request))
    except (ConnectError, ApiError) as exc:
        return error_response(as_connect(exc), streaming)


@router.post("/process.Process/{method}")
async def process_rpc(method: str, request: Request) -> Response:
    return await _rpc("process.Process", method, request)


@router.post("/filesystem.Filesystem/{method}")
async def filesystem_rpc(method: str, request: Request) -> Response:
    return await _rpc("filesystem.Filesystem", method, request)


def _files_error(exc: ApiError | ConnectError) -> JSONResponse:
    """The envd HTTP API's error body: ``{"code": <status>, "message": …}``."""
    if isinstance(exc, ConnectError):
        status = exc.http_status
    else:
        status = 507 if exc.code == "no_space" else exc.status
    return JSONResponse({"code": status, "message": exc.message}, status_code=status)


@router.get("/health", status_code=204)
async def health(request: Request) -> Response:
    """204 while the session runs; 502 otherwise (the SDK's ``is_running`` then answers False)."""
    try:
        await envd_target(request)
    except ApiError as exc:
        if exc.code == "unauthorized":
            return _files_error(exc)
        return JSONResponse({"code": 502, "message": exc.message}, status_code=502)
    return Response(status_code=204)


_PathQuery = Annotated[str | None, Query(max_length=4096)]


@router.get("/files")
async def download(request: Request, path: _PathQuery = None, username: _PathQuery = None) -> Response:
    try:
        target = await envd_target(request)
        user = process.guest_user(username) if username else _user(request)
        guest_path = filesystem.resolve_path(path, user)
        chunks, stack = await relay.download(target.session,
                                             lambda node, sandbox: node.read_file(sandbox, guest_path),
                                             "download", guest_path)
    except (ApiError, ConnectError) as exc:
        return _files_error(exc)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             background=BackgroundTask(stack.aclose))


async def _bounded(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"file larger than {limit} bytes")
        if chunk:
            yield chunk


@router.post("/files")
async def upload(request: Request, path: _PathQuery = None, username: _PathQuery = None) -> Response:
    """An octet-stream body to ``path``, or multipart file parts whose file names are their paths
    (several files at once; with ``path``, the first part goes there). Parts are streamed to the sandbox
    as they arrive (:mod:`capsa.compat.e2b.multipart`), never spooled."""
    try:
        control, target = plane(request), await envd_target(request)
        user = process.guest_user(username) if username else _user(request)
        limit = control.settings.max_file_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(f"body larger than {limit} bytes")
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise ConnectError("invalid_argument", "compressed uploads are not supported by capsa")
        written: list[dict[str, Any]] = []
        content_type = (request.headers.get("content-type") or "").lower()
        if content_type.startswith("multipart/form-data"):
            if not MULTIPART:
                raise ConnectError("unimplemented", "multipart uploads need python-multipart on the server "
                                                    "(pip install 'capsa[e2b]'); octet-stream uploads work")
            async for part in multipart.file_parts(request):  # streamed: nothing is spooled
                dest = filesystem.resolve_path(path if path and not written else part.filename, user)
                info = await _write(target, dest, _bounded(part.chunks, limit))
                written.append(filesystem.write_entry(info))
        else:
            dest = filesystem.resolve_path(path, user)
            info = await _write(target, dest, _bounded(request.stream(), limit))
            written.append(filesystem.write_entry(info))
    except (ApiError, ConnectError) as exc:
        return _files_error(exc)
    return JSONResponse(written)


async def _write(target: EnvdTarget, path: str, body: AsyncIterator[bytes]) -> node_api.FileInfo:
    digest = StreamDigest()
    chunks = digest.through(body)
    written: node_api.FileInfo = await relay.call(
        target.session, lambda node, sandbox: node.write_file(sandbox, path, None, chunks),
        audit=relay.streamed("upload", digest, path))
    return written

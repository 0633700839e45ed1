"""The in-sandbox daemon protocol (envd) the E2B SDK speaks, served by the control plane.

The SDK configured with ``E2B_SANDBOX_URL`` sends every envd request to that one URL with the sandbox in
``E2b-Sandbox-Id`` (and ``E2b-Sandbox-Port: 49983``), authenticated by ``X-Access-Token``; capsa serves
that URL at ``/e2b/envd``: Connect RPC (JSON) for ``process.Process`` and ``filesystem.Filesystem``,
``GET``/``POST /files`` and ``/health``. Each call is parsed here and becomes calls on the session's node
(``NodeClient``), which reach the guest over capsa's own channel: nothing E2B-specific runs in the VM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile

from capsa.compat.e2b import filesystem, process
from capsa.compat.e2b.access import EnvdTarget, envd_target, plane
from capsa.compat.e2b.connect import (
    ConnectError,
    as_connect,
    error_response,
    read_message,
    stream_response,
    unary_response,
)
from capsa.control.errors import ApiError, PayloadTooLarge
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.sessions import node_call_failed

__all__ = ["UNIMPLEMENTED", "router"]

router = APIRouter()

UNIMPLEMENTED = {
    "process.Process/SendInput": "stdin to processes",
    "process.Process/StreamInput": "stdin to processes",
    "process.Process/CloseStdin": "stdin to processes",
    "process.Process/Update": "PTY resize",
    "filesystem.Filesystem/WatchDir": "watching directories",
    "filesystem.Filesystem/CreateWatcher": "watching directories",
    "filesystem.Filesystem/GetWatcherEvents": "watching directories",
    "filesystem.Filesystem/RemoveWatcher": "watching directories",
}
"""envd methods capsa does not serve yet, answered ``unimplemented`` with what is missing."""
_STREAMS = {"process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir"}
_CHUNK = 1 << 20


def _user(request: Request) -> str | None:
    return process.user_from_authorization(request.headers.get("authorization"))


Unary = Callable[[ControlPlane, EnvdTarget, dict[str, Any], str | None], Awaitable[dict[str, Any]]]


def _path(message: dict[str, Any], user: str | None, key: str = "path") -> str:
    return filesystem.resolve_path(message.get(key), user)


_UNARY: dict[str, Unary] = {
    "process.Process/List": lambda c, t, m, u: process.list_processes(c, t),
    "process.Process/SendSignal": lambda c, t, m, u: process.send_signal(c, t, m),
    "filesystem.Filesystem/Stat": lambda c, t, m, u: filesystem.stat(c, t, _path(m, u)),
    "filesystem.Filesystem/MakeDir": lambda c, t, m, u: filesystem.make_dir(c, t, _path(m, u)),
    "filesystem.Filesystem/Move": lambda c, t, m, u: filesystem.move(c, t, _path(m, u, "source"),
                                                                      _path(m, u, "destination")),
    "filesystem.Filesystem/ListDir": lambda c, t, m, u: filesystem.list_dir(c, t, _path(m, u),
                                                                             m.get("depth")),
    "filesystem.Filesystem/Remove": lambda c, t, m, u: filesystem.remove(c, t, _path(m, u)),
}


async def _rpc(service: str, method: str, request: Request) -> Response:
    name = f"{service}/{method}"
    streaming = name in _STREAMS or (request.headers.get("content-type") or "").startswith(
        "application/connect+")
    try:
        if name in UNIMPLEMENTED:
            raise ConnectError("unimplemented", f"{name}: {UNIMPLEMENTED[name]} is not supported by capsa's "
                                                "E2B layer yet")
        if name not in _UNARY and name not in ("process.Process/Start", "process.Process/Connect"):
            raise ConnectError("unimplemented", f"unknown method {name}")
        message = await read_message(request)
        user = _user(request)
        control = plane(request)
        target = await envd_target(request)
        if name in _UNARY:
            return unary_response(await _UNARY[name](control, target, message, user))
        start = process.start_request(message, user) if method == "Start" else None
        return stream_response(process.stream_process(control, target, message, start=start,
                                                      timeout_ms=request.headers.get("connect-timeout-ms")))
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


async def _relay(chunks: AsyncIterator[bytes], stack: AsyncExitStack) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await stack.aclose()


_PathQuery = Annotated[str | None, Query(max_length=4096)]


@router.get("/files")
async def download(request: Request, path: _PathQuery = None, username: _PathQuery = None) -> Response:
    try:
        control, target = plane(request), await envd_target(request)
        user = process.guest_user(username) if username else _user(request)
        guest_path = filesystem.resolve_path(path, user)
        stack = AsyncExitStack()
        try:
            chunks = await stack.enter_async_context(target.client.read_file(target.sandbox_id, guest_path))
        except NodeError as exc:
            await stack.aclose()
            raise await node_call_failed(control, target.row, exc) from exc
        except BaseException:
            await stack.aclose()
            raise
    except (ApiError, ConnectError) as exc:
        return _files_error(exc)
    return StreamingResponse(_relay(chunks, stack), media_type="application/octet-stream",
                             background=BackgroundTask(stack.aclose))


async def _bounded(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"file larger than {limit} bytes")
        if chunk:
            yield chunk


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(_CHUNK):
        yield chunk


@router.post("/files")
async def upload(request: Request, path: _PathQuery = None, username: _PathQuery = None) -> Response:
    """An octet-stream body to ``path``, or multipart parts named ``file`` whose file names are their
    paths (several files at once when ``path`` is absent)."""
    try:
        control, target = plane(request), await envd_target(request)
        user = process.guest_user(username) if username else _user(request)
        limit = control.settings.max_file_bytes
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise ConnectError("invalid_argument", "compressed uploads are not supported by capsa")
        written: list[dict[str, Any]] = []
        content_type = (request.headers.get("content-type") or "").lower()
        if content_type.startswith("multipart/form-data"):
            async with request.form(max_files=1000, max_fields=1000) as form:
                for _, part in form.multi_items():
                    if not isinstance(part, UploadFile):
                        continue
                    name = path if path and len(form.getlist("file")) == 1 else part.filename
                    dest = filesystem.resolve_path(name, user)
                    info = await _write(control, target, dest, _bounded(_upload_chunks(part), limit))
                    written.append(filesystem.write_entry(info))
        else:
            dest = filesystem.resolve_path(path, user)
            info = await _write(control, target, dest, _bounded(request.stream(), limit))
            written.append(filesystem.write_entry(info))
    except (ApiError, ConnectError) as exc:
        return _files_error(exc)
    return JSONResponse(written)


async def _write(control: ControlPlane, target: EnvdTarget, path: str, body: AsyncIterator[bytes]) -> Any:
    try:
        return await target.client.write_file(target.sandbox_id, path, None, body)
    except NodeError as exc:
        raise await node_call_failed(control, target.row, exc) from exc

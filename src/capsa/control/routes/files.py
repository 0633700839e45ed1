"""``/v1/sessions/{id}/files…``: streamed file content, listings, stat, mkdir, remove, tar archives."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from capsa.common import node_api
from capsa.common.wire.streams import WATCH_EVENT, FileEvent, StreamError
from capsa.control.audit.digest import StreamDigest
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import PayloadTooLarge
from capsa.control.nodes.client import NodeClient
from capsa.control.plane import ControlPlane
from capsa.control.schemas import FileInfo, FileList
from capsa.control.sessions import process_io, relay

__all__ = ["router"]

router = APIRouter(prefix="/sessions/{session_id}/files", tags=["files"], responses=PROBLEMS)

GuestPath = Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$",
                                 description="absolute path inside the sandbox")]
_BINARY = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
_TAR = {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}


async def _bounded(request: Request, limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"body larger than {limit} bytes")
        if chunk:
            yield chunk


def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"body larger than {limit} bytes")


async def _download(plane: ControlPlane, tenant: str, session_id: str, path: str, action: str,
                    opener: Callable[[NodeClient, str], AbstractAsyncContextManager[AsyncIterator[bytes]]],
                    media_type: str) -> StreamingResponse:
    target = await relay.running(plane, tenant, session_id)
    chunks, stack = await relay.download(target, opener, action, path)
    return StreamingResponse(chunks, media_type=media_type, background=BackgroundTask(stack.aclose))


@router.get("/content", response_class=StreamingResponse, responses={200: _BINARY})
async def read_file(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> StreamingResponse:
    return await _download(plane, caller.tenant, session_id, path, "download",
                           lambda node, sandbox: node.read_file(sandbox, path), "application/octet-stream")


@router.put("/content", response_model=FileInfo, responses=problems(404, 409, 413, 503),
            openapi_extra={"requestBody": {"required": True, **_BINARY}})
async def write_file(session_id: str, path: GuestPath, request: Request, plane: Plane, caller: Caller,
                     mode: Annotated[str | None, Query(pattern=r"^[0-7]{3,4}$")] = None) -> FileInfo:
    _check_length(request, plane.settings.max_file_bytes)
    target = await relay.running(plane, caller.tenant, session_id)
    digest = StreamDigest()
    body = digest.through(_bounded(request, plane.settings.max_file_bytes))
    bits = int(mode, 8) if mode else None
    info: node_api.FileInfo = await relay.call(
        target, lambda node, sandbox: node.write_file(sandbox, path, bits, body),
        audit=relay.streamed("upload", digest, path, mode=mode))
    return FileInfo.model_validate(info.model_dump())


@router.get("/list", response_model=FileList)
async def list_dir(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> FileList:
    target = await relay.running(plane, caller.tenant, session_id)
    items = await relay.call(target, lambda node, sandbox: node.list_dir(sandbox, path))
    return FileList(items=[FileInfo.model_validate(i.model_dump()) for i in items])


@router.get("/stat", response_model=FileInfo)
async def stat(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> FileInfo:
    target = await relay.running(plane, caller.tenant, session_id)
    return FileInfo.model_validate((await relay.call(target, lambda node, sandbox: node.stat(sandbox, path)))
                                   .model_dump())


@router.post("/mkdir", response_model=FileInfo)
async def mkdir(session_id: str, path: GuestPath, plane: Plane, caller: Caller,
                parents: bool = True) -> FileInfo:
    target = await relay.running(plane, caller.tenant, session_id)
    made = await relay.call(target, lambda node, sandbox: node.mkdir(sandbox, path, parents),
                            audit=relay.Audit("file", "mkdir", lambda _: {"path": path, "parents": parents}))
    return FileInfo.model_validate(made.model_dump())


@router.delete("", status_code=204, response_class=Response)
async def remove(session_id: str, path: GuestPath, plane: Plane, caller: Caller,
                 recursive: bool = False) -> Response:
    target = await relay.running(plane, caller.tenant, session_id)
    await relay.call(target, lambda node, sandbox: node.remove(sandbox, path, recursive),
                     audit=relay.Audit("file", "delete", lambda _: {"path": path, "recursive": recursive}))
    return Response(status_code=204)


@router.get("/archive", response_class=StreamingResponse, responses={200: _TAR})
async def export_archive(session_id: str, path: GuestPath, plane: Plane,
                         caller: Caller) -> StreamingResponse:
    return await _download(plane, caller.tenant, session_id, path, "archive_download",
                           lambda node, sandbox: node.export_archive(sandbox, path), "application/x-tar")


@router.put("/archive", status_code=204, response_class=Response, responses=problems(404, 409, 413, 503),
            openapi_extra={"requestBody": {"required": True, **_TAR}})
async def import_archive(session_id: str, path: GuestPath, request: Request, plane: Plane,
                         caller: Caller) -> Response:
    _check_length(request, plane.settings.max_file_bytes)
    target = await relay.running(plane, caller.tenant, session_id)
    digest = StreamDigest()
    body = digest.through(_bounded(request, plane.settings.max_file_bytes))
    await relay.call(target, lambda node, sandbox: node.import_archive(sandbox, path, body),
                     audit=relay.streamed("archive_upload", digest, path))
    return Response(status_code=204)


@router.get("/watch", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "One WatchEvent per line, until the client closes the stream"}})
async def watch(session_id: str, path: GuestPath, plane: Plane, caller: Caller,
                recursive: bool = False) -> StreamingResponse:
    """Changes under the directory ``path`` (``created``, ``modified``, ``removed``; with ``recursive``
    also in its subdirectories) as they happen, until the client closes the stream or the directory is
    removed."""
    events = await process_io.watch_files(plane, caller.tenant, session_id, path, recursive=recursive)
    return StreamingResponse(_watch_lines(events), media_type="application/x-ndjson",
                             background=BackgroundTask(events.aclose))


async def _watch_lines(events: process_io.EventStream[FileEvent | StreamError]) -> AsyncIterator[str]:
    async for event in events:
        yield WATCH_EVENT.dump_json(event).decode() + "\n"

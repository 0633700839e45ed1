"""``/v1/sessions/{id}/files…``: streamed file content, listings, stat, mkdir, remove, tar archives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from capsa.control import audit_trail, process_io
from capsa.control.audit_digest import StreamDigest
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import PayloadTooLarge
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.schemas import FileInfo, FileList
from capsa.control.sessions import node_call_failed, running_session
from capsa.control.store.models import SessionRow
from capsa.sdk.models import WATCH_EVENT, FileEvent, StreamError

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


async def _relay(chunks: AsyncIterator[bytes], stack: AsyncExitStack, row: SessionRow, action: str,
                 path: str) -> AsyncIterator[bytes]:
    digest = StreamDigest()
    try:
        async for chunk in digest.through(chunks):
            yield chunk
    finally:
        # Noted before the response's last message, so it is written with the request's api event.
        audit_trail.note("file", action, session_id=row.id, detail=digest.detail(path))
        await stack.aclose()


async def _open_stream(plane: ControlPlane, row: SessionRow,
                       opener: AbstractAsyncContextManager[AsyncIterator[bytes]],
                       ) -> tuple[AsyncIterator[bytes], AsyncExitStack]:
    stack = AsyncExitStack()
    try:
        chunks = await stack.enter_async_context(opener)
    except NodeError as exc:
        await stack.aclose()
        raise await node_call_failed(plane, row, exc) from exc
    except BaseException:
        await stack.aclose()
        raise
    return chunks, stack


@router.get("/content", response_class=StreamingResponse, responses={200: _BINARY})
async def read_file(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> StreamingResponse:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    chunks, stack = await _open_stream(plane, row, client.read_file(row.sandbox_id, path))
    return StreamingResponse(_relay(chunks, stack, row, "download", path),
                             media_type="application/octet-stream",
                             background=BackgroundTask(stack.aclose))


@router.put("/content", response_model=FileInfo, responses=problems(404, 409, 413, 503),
            openapi_extra={"requestBody": {"required": True, **_BINARY}})
async def write_file(session_id: str, path: GuestPath, request: Request, plane: Plane, caller: Caller,
                     mode: Annotated[str | None, Query(pattern=r"^[0-7]{3,4}$")] = None) -> FileInfo:
    _check_length(request, plane.settings.max_file_bytes)
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    digest = StreamDigest()
    try:
        info = await client.write_file(row.sandbox_id, path, int(mode, 8) if mode else None,
                                       digest.through(_bounded(request, plane.settings.max_file_bytes)))
    except NodeError as exc:
        audit_trail.note("file", "upload", session_id=row.id, detail=digest.detail(path, error=exc.code))
        raise await node_call_failed(plane, row, exc) from exc
    audit_trail.note("file", "upload", session_id=row.id, detail=digest.detail(path, mode=mode))
    return FileInfo.model_validate(info.model_dump())


@router.get("/list", response_model=FileList)
async def list_dir(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> FileList:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        items = await client.list_dir(row.sandbox_id, path)
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    return FileList(items=[FileInfo.model_validate(i.model_dump()) for i in items])


@router.get("/stat", response_model=FileInfo)
async def stat(session_id: str, path: GuestPath, plane: Plane, caller: Caller) -> FileInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        return FileInfo.model_validate((await client.stat(row.sandbox_id, path)).model_dump())
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc


@router.post("/mkdir", response_model=FileInfo)
async def mkdir(session_id: str, path: GuestPath, plane: Plane, caller: Caller,
                parents: bool = True) -> FileInfo:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        made = FileInfo.model_validate((await client.mkdir(row.sandbox_id, path, parents)).model_dump())
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    audit_trail.note("file", "mkdir", session_id=row.id, detail={"path": path, "parents": parents})
    return made


@router.delete("", status_code=204, response_class=Response)
async def remove(session_id: str, path: GuestPath, plane: Plane, caller: Caller,
                 recursive: bool = False) -> Response:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    try:
        await client.remove(row.sandbox_id, path, recursive)
    except NodeError as exc:
        raise await node_call_failed(plane, row, exc) from exc
    audit_trail.note("file", "delete", session_id=row.id, detail={"path": path, "recursive": recursive})
    return Response(status_code=204)


@router.get("/archive", response_class=StreamingResponse, responses={200: _TAR})
async def export_archive(session_id: str, path: GuestPath, plane: Plane,
                         caller: Caller) -> StreamingResponse:
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    chunks, stack = await _open_stream(plane, row, client.export_archive(row.sandbox_id, path))
    return StreamingResponse(_relay(chunks, stack, row, "archive_download", path),
                             media_type="application/x-tar",
                             background=BackgroundTask(stack.aclose))


@router.put("/archive", status_code=204, response_class=Response, responses=problems(404, 409, 413, 503),
            openapi_extra={"requestBody": {"required": True, **_TAR}})
async def import_archive(session_id: str, path: GuestPath, request: Request, plane: Plane,
                         caller: Caller) -> Response:
    _check_length(request, plane.settings.max_file_bytes)
    row, client = await running_session(plane, caller.tenant, session_id)
    assert row.sandbox_id is not None
    digest = StreamDigest()
    try:
        await client.import_archive(row.sandbox_id, path,
                                    digest.through(_bounded(request, plane.settings.max_file_bytes)))
    except NodeError as exc:
        audit_trail.note("file", "archive_upload", session_id=row.id,
                         detail=digest.detail(path, error=exc.code))
        raise await node_call_failed(plane, row, exc) from exc
    audit_trail.note("file", "archive_upload", session_id=row.id, detail=digest.detail(path))
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

"""Files in a sandbox: content (streamed both ways), listings, stat, mkdir, rename, remove, tar archives."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from capsa.common.errors import CapsaError
from capsa.common.node_api import NDJSON, FileInfo, FileList
from capsa.common.wire.streams import WATCH_EVENT, FileEvent, StreamError
from capsa.guest.results import FileInfo as GuestFile
from capsa.node.api.deps import Agent, GuestPath
from capsa.node.guestlink.handles.watch import DirWatch

__all__ = ["file_info", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/sandboxes/{sandbox_id}/files", tags=["files"])


def file_info(info: GuestFile) -> FileInfo:
    return FileInfo.model_validate(info, from_attributes=True)


async def _relay(sandbox_id: str, chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except CapsaError as exc:
        # The status line is gone already: aborting the response is the only way to say "incomplete".
        log.warning("stream from sandbox %s failed midway: %s", sandbox_id, exc.message)
        raise
    finally:
        await chunks.aclose()


@router.get("/watch", response_class=StreamingResponse,
            responses={200: {"content": {NDJSON: {}}, "description": "WatchEvent lines"}})
async def watch(agent: Agent, sandbox_id: str, path: GuestPath,
                recursive: bool = False) -> StreamingResponse:
    """Changes under the directory, one :data:`WatchEvent` per line, until the client closes the stream
    (or the directory is removed)."""
    watcher = await agent.guest(sandbox_id).watch_dir(path, recursive=recursive)
    return StreamingResponse(_watch_lines(watcher), media_type=NDJSON)


async def _watch_lines(watcher: DirWatch) -> AsyncIterator[bytes]:
    events = watcher.events()
    try:
        async for event in events:
            yield WATCH_EVENT.dump_json(FileEvent(type=event.type, path=event.path,  # type: ignore[arg-type]
                                                  is_dir=event.is_dir)) + b"\n"
    except CapsaError as exc:
        yield WATCH_EVENT.dump_json(StreamError(code=exc.code, detail=exc.message)) + b"\n"
    finally:
        await events.aclose()
        await watcher.close()


@router.get("/content", response_class=StreamingResponse)
async def read_file(agent: Agent, sandbox_id: str, path: GuestPath) -> StreamingResponse:
    chunks = await agent.guest(sandbox_id).read_file(path)
    return StreamingResponse(_relay(sandbox_id, chunks), media_type="application/octet-stream")


@router.put("/content", response_model=FileInfo)
async def write_file(agent: Agent, sandbox_id: str, path: GuestPath, request: Request,
                     mode: Annotated[str | None, Query(pattern=r"^[0-7]{3,4}$")] = None) -> FileInfo:
    return file_info(await agent.guest(sandbox_id).write_file(path, request.stream(),
                                                              mode=int(mode, 8) if mode else None))


@router.get("/list", response_model=FileList)
async def list_dir(agent: Agent, sandbox_id: str, path: GuestPath) -> FileList:
    return FileList(items=[file_info(i) for i in await agent.guest(sandbox_id).list_dir(path)])


@router.get("/stat", response_model=FileInfo)
async def stat(agent: Agent, sandbox_id: str, path: GuestPath) -> FileInfo:
    return file_info(await agent.guest(sandbox_id).stat(path))


@router.post("/mkdir", response_model=FileInfo)
async def mkdir(agent: Agent, sandbox_id: str, path: GuestPath, parents: bool = True) -> FileInfo:
    return file_info(await agent.guest(sandbox_id).mkdir(path, parents=parents))


@router.post("/rename", response_model=FileInfo)
async def rename(agent: Agent, sandbox_id: str, path: GuestPath, to: GuestPath) -> FileInfo:
    """Move ``path`` to ``to`` (a rename in the guest; across filesystems a copy); answers ``to``'s info."""
    return file_info(await agent.guest(sandbox_id).rename(path, to))


@router.delete("", status_code=204, response_class=Response)
async def remove(agent: Agent, sandbox_id: str, path: GuestPath, recursive: bool = False) -> Response:
    await agent.guest(sandbox_id).remove(path, recursive=recursive)
    return Response(status_code=204)


@router.get("/archive", response_class=StreamingResponse)
async def export_archive(agent: Agent, sandbox_id: str, path: GuestPath) -> StreamingResponse:
    chunks = await agent.guest(sandbox_id).export_archive(path)
    return StreamingResponse(_relay(sandbox_id, chunks), media_type="application/x-tar")


@router.put("/archive", status_code=204, response_class=Response)
async def import_archive(agent: Agent, sandbox_id: str, path: GuestPath, request: Request) -> Response:
    await agent.guest(sandbox_id).import_archive(path, request.stream())
    return Response(status_code=204)

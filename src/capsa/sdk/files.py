"""Files inside a session's guest: small reads/writes in memory, large ones streamed both ways."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import IO, Any, Self

from capsa.common.wire.streams import WATCH_EVENT, FileEvent, StreamError
from capsa.sdk.errors import NotFound, error_from_problem
from capsa.sdk.models import FileInfo, parse_event
from capsa.sdk.resource import SessionResource

__all__ = [
    "AsyncFiles",
    "AsyncWatch",
    "UploadSource",
]

UploadSource = str | os.PathLike[str] | bytes | IO[bytes] | AsyncIterable[bytes] | Iterable[bytes]
"""A local path (``str`` or ``Path``), bytes, a binary file object, or an (async) iterable of chunks."""

_CHUNK = 256 * 1024


async def _file_chunks(f: IO[bytes]) -> AsyncIterator[bytes]:
    while True:
        # Disk reads happen off the event loop so one large upload does not stall other requests.
        data = await asyncio.to_thread(f.read, _CHUNK)
        if not data:
            return
        yield data


async def _iter_chunks(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield bytes(chunk)


async def _path_chunks(path: Path) -> AsyncIterator[bytes]:
    f = await asyncio.to_thread(path.open, "rb")
    try:
        async for chunk in _file_chunks(f):
            yield chunk
    finally:
        f.close()


def _as_body(source: UploadSource) -> bytes | AsyncIterator[bytes] | AsyncIterable[bytes]:
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            # Fail here, before a request is made, with the local path in the message.
            raise FileNotFoundError(f"no such local file: {path}")
        return _path_chunks(path)
    if isinstance(source, AsyncIterable):
        return source
    if hasattr(source, "read"):
        return _file_chunks(source)  # type: ignore[arg-type]
    if isinstance(source, Iterable):
        return _iter_chunks(source)
    raise TypeError(f"cannot upload from {type(source).__name__}")


class AsyncFiles(SessionResource):
    """``session.files``: paths are absolute paths inside the guest."""

    def _url(self, suffix: str) -> str:
        return f"{self._base}/files{suffix}"

    async def read_bytes(self, path: str) -> bytes:
        response = await self._client.request("GET", self._url("/content"), params={"path": path})
        return response.content

    async def read(self, path: str, *, encoding: str = "utf-8", errors: str = "strict") -> str:
        return (await self.read_bytes(path)).decode(encoding, errors)

    async def write(self, path: str, data: str | bytes, *, mode: int | None = None) -> FileInfo:
        """Create or replace ``path`` with ``data`` (str is encoded as UTF-8). ``mode`` like ``0o644``."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        return await self.upload(path, content, mode=mode)

    async def upload(self, path: str, source: UploadSource, *, mode: int | None = None) -> FileInfo:
        """Stream ``source`` into ``path`` without holding it in memory (except when given as bytes)."""
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        body = _as_body(source)
        return await self._call(FileInfo, "PUT", self._url("/content"), params=params, content=body,
                                headers={"Content-Type": "application/octet-stream"})

    async def iter_bytes(self, path: str, *, chunk_size: int = _CHUNK) -> AsyncIterator[bytes]:
        """Stream the content of ``path`` chunk by chunk."""
        async with self._client.stream("GET", self._url("/content"), params={"path": path}) as response:
            async for chunk in response.aiter_bytes(chunk_size):
                yield chunk

    async def watch(self, path: str, *, recursive: bool = False) -> AsyncWatch:
        """Watch the directory ``path``: every change made after this returns is reported (``created``,
        ``modified``, ``removed``; with ``recursive`` in subdirectories too). Iterate the answer; close it
        (``aclose()`` or ``async with``) to stop. Iteration ends if the directory is removed."""
        stack = contextlib.AsyncExitStack()
        try:
            params = {"path": path, "recursive": "true" if recursive else "false"}
            response = await stack.enter_async_context(self._client.stream(
                "GET", self._url("/watch"), params=params, timeout=None))
        except BaseException:
            await stack.aclose()
            raise
        return AsyncWatch(response.aiter_lines(), stack)

    async def download(self, path: str, dest: str | os.PathLike[str] | IO[bytes]) -> int:
        """Stream ``path`` into a local file (path or binary file object); return the number of bytes.

        A local destination path is written to a temporary file first and renamed at the end, so a
        failed download never leaves a partial file under the destination's name.
        """
        return await self._download(self._url("/content"), path, dest)

    async def list(self, path: str) -> builtins.list[FileInfo]:
        return await self._list(FileInfo, self._url("/list"), params={"path": path})

    async def stat(self, path: str) -> FileInfo:
        return await self._call(FileInfo, "GET", self._url("/stat"), params={"path": path})

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True) -> FileInfo:
        return await self._call(FileInfo, "POST", self._url("/mkdir"),
                                params={"path": path, "parents": parents})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._client.request("DELETE", self._url(""), params={"path": path, "recursive": recursive})

    async def upload_tar(self, path: str, source: UploadSource) -> None:
        """Unpack a tar stream into the guest directory ``path``."""
        await self._client.request("PUT", self._url("/archive"), params={"path": path},
                                   content=_as_body(source), headers={"Content-Type": "application/x-tar"})

    async def download_tar(self, path: str, dest: str | os.PathLike[str] | IO[bytes]) -> int:
        """Stream the guest directory ``path`` as a tar archive into ``dest``; return its size."""
        return await self._download(self._url("/archive"), path, dest)

    async def _download(self, url: str, path: str, dest: str | os.PathLike[str] | IO[bytes]) -> int:
        if not isinstance(dest, str | os.PathLike):
            return await self._copy_to(url, path, dest)
        target = Path(dest)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                size = await self._copy_to(url, path, f)
            os.replace(tmp_name, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        return size

    async def _copy_to(self, url: str, path: str, f: IO[bytes]) -> int:
        size = 0
        async with self._client.stream("GET", url, params={"path": path}) as response:
            async for chunk in response.aiter_bytes(_CHUNK):
                await asyncio.to_thread(f.write, chunk)
                size += len(chunk)
        return size


class AsyncWatch:
    """An open directory watch (:meth:`AsyncFiles.watch`): ``async for event in watch``; ``aclose()``."""

    def __init__(self, lines: AsyncIterator[str], stack: contextlib.AsyncExitStack) -> None:
        self._lines = lines
        self._stack = stack
        self.closed = False

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __anext__(self) -> FileEvent:
        while not self.closed:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                await self.aclose()
                break
            if not line.strip():
                continue
            event = parse_event(WATCH_EVENT, line, "a watch stream")
            if isinstance(event, StreamError):
                await self.aclose()
                raise error_from_problem(0, event.model_dump())
            if event is not None:
                return event
        raise StopAsyncIteration

    async def next(self) -> FileEvent | None:
        """The next event; None once the watch has ended."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    async def aclose(self) -> None:
        """Stop watching (the guest drops its watch)."""
        self.closed = True
        await self._stack.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()



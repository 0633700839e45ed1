"""The file parts of a ``multipart/form-data`` body as they arrive, for envd uploads (``POST /files``).

Starlette's form parser spools every file part whole (to a temporary file past 1 MiB) before the route
sees it, so a body's full size reached the disk before any limit was checked. Here each part's bytes are
handed on as the request streams in (through ``python-multipart``'s push parser, the ``capsa[e2b]``
extra): nothing is written anywhere but the sandbox, and the request guard's limit on the body
(``max_file_bytes``) stops the reading itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from capsa.compat.e2b.connect import ConnectError

__all__ = ["MAX_PARTS", "FilePart", "file_parts"]

MAX_PARTS = 1000
"""Parts (files and fields) one upload may hold."""


@dataclass
class FilePart:
    """One file part: its form field name, its file name, and its bytes (read them before the next part;
    what is left unread is skipped)."""

    name: str
    filename: str
    chunks: AsyncIterator[bytes]


class _Events:
    """The parser's events (``begin``, ``header``, ``headers``, ``data``, ``end``, ``finish``), produced
    by feeding it the request's chunks only when none is waiting."""

    def __init__(self, request: Request, boundary: bytes) -> None:
        from python_multipart.multipart import MultipartParser

        self._queue: deque[tuple[str, Any]] = deque()
        self._stream = request.stream().__aiter__()
        self._ended = False
        self._field = bytearray()
        self._value = bytearray()
        push = self._queue.append

        def header_end() -> None:
            push(("header", (bytes(self._field).lower(), bytes(self._value))))
            self._field.clear()
            self._value.clear()

        self._parser = MultipartParser(boundary, {
            "on_part_begin": lambda: push(("begin", None)),
            "on_header_field": lambda data, start, end: self._field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._value.extend(data[start:end]),
            "on_header_end": header_end,
            "on_headers_finished": lambda: push(("headers", None)),
            "on_part_data": lambda data, start, end: push(("data", bytes(data[start:end]))),
            "on_part_end": lambda: push(("end", None)),
            "on_end": lambda: push(("finish", None)),
        })

    async def next(self) -> tuple[str, Any]:
        from python_multipart.exceptions import MultipartParseError

        while not self._queue:
            if self._ended:
                raise ConnectError("invalid_argument", "the multipart body ends before its last boundary")
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                self._ended = True
                self._parser.finalize()
                continue
            try:
                self._parser.write(chunk)
            except MultipartParseError as exc:
                raise ConnectError("invalid_argument", f"malformed multipart body: {exc}") from None
        return self._queue.popleft()

    async def part_data(self) -> AsyncIterator[bytes]:
        while True:
            kind, value = await self.next()
            if kind == "end":
                return
            if kind == "data" and value:
                yield value


def _boundary(content_type: str) -> bytes:
    from python_multipart.multipart import parse_options_header

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise ConnectError("invalid_argument", "multipart/form-data without a boundary")
    return boundary


async def file_parts(request: Request) -> AsyncIterator[FilePart]:
    """The file parts of the request's multipart body, in order, each streamed (fields without a file
    name are skipped). Raises ``ConnectError`` on a malformed body or past :data:`MAX_PARTS` parts."""
    from python_multipart.multipart import parse_options_header

    events = _Events(request, _boundary(request.headers.get("content-type", "")))
    parts = 0
    while True:
        kind, _ = await events.next()
        if kind == "finish":
            return
        if kind != "begin":
            continue
        parts += 1
        if parts > MAX_PARTS:
            raise ConnectError("invalid_argument", f"more than {MAX_PARTS} parts in one upload")
        headers: dict[bytes, bytes] = {}
        while (event := await events.next())[0] == "header":
            headers[event[1][0]] = event[1][1]
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        data = events.part_data()
        filename = options.get(b"filename")
        if filename is not None:
            yield FilePart(options.get(b"name", b"").decode(errors="replace"),
                           filename.decode(errors="replace"), data)
        async for _ in data:  # what the caller left unread (all of a field without a file name)
            pass

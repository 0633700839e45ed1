"""The events of the NDJSON streams a node sends and the control plane relays unchanged to its clients:
a background process's output (``/processes/{pid}/stream``), a watched directory's changes
(``/files/watch``), and the output and error events of a streamed command (whose ``result`` event differs
between the node API and the public one, so each declares its own)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from capsa.common.wire.base import Answer

__all__ = ["OUTPUT_EVENT", "WATCH_EVENT", "ExecError", "ExecOutput", "FileEvent", "OutputChunk", "OutputEnd",
           "OutputEvent", "StreamError", "WatchEvent"]


class StreamError(Answer):
    """The last line of an NDJSON stream that broke after the HTTP status was sent."""

    type: Literal["error"] = "error"
    code: str
    detail: str


class ExecOutput(Answer):
    """A piece of the command's output, decoded as UTF-8 (invalid bytes replaced)."""

    type: Literal["stdout", "stderr"]
    data: str


class ExecError(StreamError):
    """The last event of a stream whose command could not finish (the HTTP status was sent already)."""


class OutputChunk(Answer):
    """A piece of a background process's output in ``GET /processes/{pid}/stream`` (UTF-8; a character
    cut by a chunk boundary comes whole in the next line)."""

    type: Literal["output"] = "output"
    ch: Literal["stdout", "stderr"]
    data: str
    offset: int
    """Byte offset in ``ch`` just after this chunk: reconnect with ``{ch}_from=offset`` to get what follows
    (nothing lost, nothing repeated)."""
    lost: int = 0
    """Bytes before this chunk that were asked for but had left the guest's ring buffer (1 MiB per stream)."""


class OutputEnd(Answer):
    """The last line of a process stream: the process exited and all of its output was sent."""

    type: Literal["exit"] = "exit"
    exit_code: int | None = None
    signal: int | None = None
    stdout_end: int = 0
    stderr_end: int = 0


OutputEvent = Annotated[OutputChunk | OutputEnd | StreamError, Field(discriminator="type")]
"""One line of a process's output stream: output, then one ``exit`` or ``error``."""
OUTPUT_EVENT: TypeAdapter[OutputChunk | OutputEnd | StreamError] = TypeAdapter(OutputEvent)


class FileEvent(Answer):
    """A change in a watched directory (``GET /files/watch``)."""

    type: Literal["created", "modified", "removed", "overflow"]
    """``overflow``: the guest kernel dropped events (too many at once)."""
    path: str
    is_dir: bool = False


WatchEvent = Annotated[FileEvent | StreamError, Field(discriminator="type")]
"""One line of a directory watch."""
WATCH_EVENT: TypeAdapter[FileEvent | StreamError] = TypeAdapter(WatchEvent)

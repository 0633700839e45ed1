"""The public API's answers, declared once: the SDK parses them and the control plane serves them.

These models are the contract of ``/v1`` (spec/api.openapi.json): ``capsa.control.schemas`` imports them
instead of declaring the same shapes again. Unknown fields are ignored so newer servers stay compatible, and
fields whose values may grow (a session's state, a snapshot's kind, a file's type) are plain strings whose
known values the schema lists, so a value added later does not break an older client.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from capsa.common.wire.base import Answer, known
from capsa.common.wire.streams import ExecError, ExecOutput
from capsa.sdk.errors import UnexpectedResponse

__all__ = [
    "EXEC_EVENT",
    "ApiKey",
    "CommandResult",
    "CommandStatus",
    "ExecEvent",
    "ExecFinished",
    "FileInfo",
    "PortToken",
    "PortTokenInfo",
    "ProcessInfo",
    "ProcessOutput",
    "RollingSnapshots",
    "SessionInfo",
    "SessionState",
    "SnapshotInfo",
    "iter_events",
    "parse",
    "parse_event",
    "parse_items",
]

SessionState = Literal["creating", "running", "recovering", "paused", "closed", "failed"]
SnapshotKind = Literal["manual", "rolling", "pause", "branch"]
FileType = Literal["file", "dir", "symlink", "other"]
OnTimeout = Literal["pause", "close"]


class _Sent(Answer):
    """An answer whose defaults only make the client tolerant: the server always sends every field, so the
    schema lists them all as required."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class RollingSnapshots(BaseModel):
    """Snapshots the control plane takes by itself, so the session survives the loss of its sandbox."""

    # Also the body clients send (SessionCreate.rolling_snapshots): unknown fields are refused.
    model_config = ConfigDict(frozen=True, extra="forbid")

    interval_s: Annotated[int, Field(ge=10, le=86400)] | None = None
    """Snapshot every this many seconds while the session is active (only if something happened since)."""
    after_command: bool = False
    """Snapshot after each command that ran to completion."""
    keep: Annotated[int, Field(ge=1, le=32)] = 3
    """How many rolling snapshots are kept (older ones are deleted)."""
    max_age_s: Annotated[int, Field(ge=60, le=7 * 86400)] | None = None
    """Rolling snapshots older than this are deleted too (the newest is always kept); at most a week."""


class SessionInfo(Answer):
    id: str
    tenant: str
    state: Annotated[str, known(SessionState)]
    """One of :data:`SessionState`."""
    template: str
    created_at: datetime
    updated_at: datetime
    expires_at: datetime
    idle_timeout: int | None
    last_activity_at: datetime
    metadata: dict[str, str]
    memory_mib: int
    vcpus: int
    node_id: str | None
    """The node the session's sandbox runs on (None while it has none)."""
    failure_reason: str | None
    closed_at: datetime | None
    on_timeout: Annotated[str, known(OnTimeout)] = "close"
    """``pause`` or ``close``: what happens when the session's TTL or idle timeout passes."""
    rolling_snapshots: RollingSnapshots | None = None
    keep_snapshots: bool = False
    pause_reason: str | None = None
    """Why a paused session was paused (``paused``, ``timeout``, ``idle_timeout``, or a lost sandbox)."""
    expose: list[int] | None = None
    """The only ports the port proxy reaches (None: any port)."""


class PortToken(Answer):
    """An access token for one port of one session (``POST /v1/sessions/{id}/ports/{port}/tokens``)."""

    id: str
    session_id: str
    port: int
    token: str
    """Shown once (stored hashed): pass it as ``?token=`` or the ``X-Capsa-Port-Token`` header."""
    url: str
    """The port's URL with the token in its query: its own host under the API's ports domain when it has
    one (``https://8080-ses_….ports.example.com/?token=…``), else the API's path route."""
    created_at: datetime
    expires_at: datetime | None = None
    """When the token stops working (``ttl_seconds`` after it was made; the API's default is a day)."""


class PortTokenInfo(Answer):
    """A port token as ``GET /v1/sessions/{id}/port-tokens`` lists it (never the token itself): those made
    with ``POST …/ports/{port}/tokens`` and those ``GET …/browser`` made for its URLs."""

    id: str
    session_id: str
    port: int
    created_at: datetime
    expires_at: datetime | None = None


class SnapshotInfo(Answer):
    id: str
    session_id: str
    kind: Annotated[str, known(SnapshotKind)]
    """manual | rolling | pause | branch"""
    created_at: datetime
    size_bytes: int | None
    parent: str | None
    node_id: str
    stored: bool = False
    """In the fleet's store: restorable on any node that reads it, not only on ``node_id``."""


class CommandStatus(_Sent):
    """How a command ended: the fields shared by :class:`CommandResult` and the stream's ``result`` event."""

    exit_code: int | None = None
    """None when the process was killed by a signal (see ``signal``) or timed out."""
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class CommandResult(CommandStatus):
    """The answer of ``POST /sessions/{id}/commands`` (and what a streamed command adds up to)."""

    stdout: str = ""
    stderr: str = ""


class ExecFinished(CommandStatus):
    """The last event of a stream whose command ran to its end (the output came in the events before)."""

    type: Literal["result"] = "result"


ExecEvent = Annotated[ExecOutput | ExecFinished | ExecError, Field(discriminator="type")]
"""One line of the NDJSON stream of ``POST /sessions/{id}/commands`` with ``Accept: application/x-ndjson``:
output events, then exactly one ``result`` or ``error``."""
EXEC_EVENT: TypeAdapter[ExecOutput | ExecFinished | ExecError] = TypeAdapter(ExecEvent)
"""Parses (``EXEC_EVENT.validate_json(line)``) and serializes (``dump_json``) one :data:`ExecEvent`."""


class ProcessInfo(_Sent):
    pid: int
    cmd: list[str] = Field(default_factory=list)
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    started_at: datetime
    stdin_open: bool = False
    """Started with ``open_stdin`` and its stdin not closed yet (``/processes/{pid}/stdin`` takes bytes)."""


class ProcessOutput(_Sent):
    stdout: str = ""
    stderr: str = ""
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class FileInfo(Answer):
    path: str
    name: str
    type: Annotated[str, known(FileType)]
    """file | dir | symlink | other"""
    size: int
    mode: int
    mtime: float

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


class ApiKey(Answer):
    id: str
    tenant: str
    admin: bool = False
    name: str | None = None
    created_at: datetime | None = None
    revoked_at: datetime | None = None
    key: str | None = None
    """The secret; only present in the answer to ``create``, never retrievable later."""


M = TypeVar("M", bound=BaseModel)
E = TypeVar("E")


def parse(model: type[M], data: Any) -> M:
    """Validate an API answer; a malformed one raises :class:`UnexpectedResponse`, not a pydantic error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UnexpectedResponse(
            f"the API sent a malformed {model.__name__} ({where}: {first['msg']})") from None


def parse_event(adapter: TypeAdapter[E], line: str, stream: str) -> E | None:
    """One line of a JSON-lines stream (``stream`` names it in the error); None for an event type this SDK
    does not know (a newer server may add some). A malformed line raises :class:`UnexpectedResponse`."""
    try:
        return adapter.validate_json(line)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "union_tag_invalid":
            return None
        raise UnexpectedResponse(f"malformed line in {stream}: {line[:80]!r}") from None


async def iter_events(lines: AsyncIterable[str], adapter: TypeAdapter[E], stream: str) -> AsyncIterator[E]:
    """The events of a JSON-lines stream (:func:`parse_event`), blank lines and unknown event types
    skipped."""
    async for line in lines:
        if line.strip() and (event := parse_event(adapter, line, stream)) is not None:
            yield event


def parse_items(model: type[M], data: Any) -> list[M]:
    """The ``items`` of a list answer (``{"items": [...]}``)."""
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise UnexpectedResponse(f"the API sent a list of {model.__name__} without an 'items' array")
    return [parse(model, item) for item in items]

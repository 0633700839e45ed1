"""Typed views of the API's JSON objects. Unknown fields are ignored so newer servers stay compatible."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capsa.sdk.errors import UnexpectedResponse

__all__ = [
    "ApiKey",
    "CommandResult",
    "FileInfo",
    "ProcessInfo",
    "ProcessOutput",
    "SessionInfo",
    "SessionState",
    "SnapshotInfo",
    "parse",
    "parse_items",
]

SessionState = Literal["creating", "running", "paused", "closed", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class SessionInfo(_Model):
    id: str
    tenant: str
    state: str
    """One of :data:`SessionState`; kept as ``str`` so a state added later does not break old clients."""
    template: str
    created_at: datetime
    updated_at: datetime | None = None
    expires_at: datetime | None = None
    idle_timeout: int | None = None
    last_activity_at: datetime | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    memory_mib: int | None = None
    vcpus: int | None = None
    node_id: str | None = None
    failure_reason: str | None = None
    closed_at: datetime | None = None
    on_timeout: str = "close"
    """``pause`` or ``close``: what happens when the session's TTL or idle timeout passes."""
    rolling_snapshots: dict[str, Any] | None = None
    """The rolling snapshot policy (``interval_s``, ``after_command``, ``keep``), if any."""
    keep_snapshots: bool = False
    pause_reason: str | None = None
    """Why a paused session is paused (``paused``, ``timeout``, a lost sandbox…)."""


class SnapshotInfo(_Model):
    id: str
    session_id: str
    kind: str
    """manual | rolling | pause | branch"""
    created_at: datetime
    size_bytes: int | None = None
    parent: str | None = None
    node_id: str | None = None


class CommandResult(_Model):
    exit_code: int | None = None
    """None when the process was killed by a signal (see ``signal``) or timed out."""
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class ProcessInfo(_Model):
    pid: int
    cmd: list[str] = Field(default_factory=list)
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    started_at: datetime | None = None


class ProcessOutput(_Model):
    stdout: str = ""
    stderr: str = ""
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class FileInfo(_Model):
    path: str
    name: str
    type: str
    """file | dir | symlink | other"""
    size: int
    mode: int
    mtime: float

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


class ApiKey(_Model):
    id: str
    tenant: str
    admin: bool = False
    name: str | None = None
    created_at: datetime | None = None
    revoked_at: datetime | None = None
    key: str | None = None
    """The secret; only present in the answer to ``create``, never retrievable later."""


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: Any) -> M:
    """Validate an API answer; a malformed one raises :class:`UnexpectedResponse`, not a pydantic error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UnexpectedResponse(
            f"the API sent a malformed {model.__name__} ({where}: {first['msg']})") from None


def parse_items(model: type[M], data: Any) -> list[M]:
    """The ``items`` of a list answer (``{"items": [...]}``)."""
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise UnexpectedResponse(f"the API sent a list of {model.__name__} without an 'items' array")
    return [parse(model, item) for item in items]

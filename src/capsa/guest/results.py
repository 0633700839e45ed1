"""Typed results of guest operations, declared once for both sides of the guest channel.

The guest daemon builds these and sends them as a RESULT frame's meta (``to_meta``); the node's guest
client parses the meta back (``from_meta``), trusting nothing: a hostile guest can send any JSON, and a
meta that does not fit raises ``KeyError``/``ValueError``/``TypeError``. Standard library only (the module
ships in the guest image with the daemon).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["FileInfo", "ProcessInfo", "WatchEvent", "exit_fields", "opt_float", "opt_int"]

WATCH_EVENT_TYPES = ("created", "modified", "removed", "overflow")


def opt_int(value: object) -> int | None:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def opt_float(value: object) -> float | None:
    """``value`` as a float if it is a number (not a bool), else None."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def exit_fields(returncode: int | None) -> dict[str, Any]:
    """``exit_code`` and ``signal`` of a process's return code (None: still running)."""
    if returncode is None:
        return {"exit_code": None, "signal": None}
    if returncode < 0:
        return {"exit_code": None, "signal": -returncode}
    return {"exit_code": returncode, "signal": None}


@dataclass(frozen=True)
class ProcessInfo:
    """A background process (``proc_start``, ``proc_list``, ``proc_kill``, stdin calls)."""

    pid: int
    cmd: str
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: float
    finished_at: float | None = None
    stdin_open: bool = False
    """The process was started with ``stdin`` and its stdin is not closed yet."""

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ProcessInfo:
        return cls(pid=int(meta["pid"]), cmd=str(meta.get("cmd", "")), running=bool(meta.get("running")),
                   exit_code=opt_int(meta.get("exit_code")), signal=opt_int(meta.get("signal")),
                   started_at=float(meta.get("started_at") or 0.0),
                   finished_at=opt_float(meta.get("finished_at")), stdin_open=meta.get("stdin_open") is True)


@dataclass(frozen=True)
class FileInfo:
    """A file, directory or link (``file_stat``, ``file_list`` entries, ``file_write``, ``file_mkdir``)."""

    path: str
    name: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int  # permission bits
    mtime: float

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> FileInfo:
        return cls(path=str(meta["path"]), name=str(meta["name"]), type=str(meta["type"]),
                   size=int(meta["size"]), mode=int(meta["mode"]), mtime=float(meta["mtime"]))


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched directory (``file_watch``: one JSON object per line)."""

    type: str  # "created" | "modified" | "removed" | "overflow"
    path: str
    is_dir: bool

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> WatchEvent:
        kind, path = meta["type"], meta["path"]
        if kind not in WATCH_EVENT_TYPES or not isinstance(path, str):
            raise ValueError(kind)
        return cls(kind, path, meta.get("is_dir") is True)

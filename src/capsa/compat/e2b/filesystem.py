"""envd's ``filesystem.Filesystem`` service and its ``/files`` upload/download endpoints, on capsa's file
operations (stat, list, mkdir, rename, remove, streamed read and write through the session's node).

Relative paths (and ``~``) are resolved against the user's home as envd does: ``/root`` for capsa's
default user, ``/home/<user>`` for another.
"""

from __future__ import annotations

import posixpath
import stat as statmod
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from capsa.common import node_api
from capsa.compat.e2b.access import EnvdTarget
from capsa.compat.e2b.connect import ConnectError
from capsa.control.errors import ApiError
from capsa.control.plane import ControlPlane
from capsa.control.sessions import relay

__all__ = ["MAX_DEPTH", "MAX_LISTINGS", "entry_info", "list_dir", "make_dir", "move", "remove",
           "resolve_path", "stat", "write_entry"]

MAX_DEPTH = 8
"""Deepest ``ListDir`` recursion served (each level is one listing per directory)."""
MAX_LISTINGS = 1_000
"""Most directories one ``ListDir`` lists (one node call each); a deeper tree is refused
(``resource_exhausted``) before the call past it is made."""
_MAX_ENTRIES = 100_000
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY"}
_MODE_BITS = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}


def resolve_path(path: object, user: str | None) -> str:
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise ConnectError("invalid_argument", "path must be a non-empty string")
    home = "/root" if user is None else f"/home/{user}"
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(home, path)
    return posixpath.normpath(path) if path != "/" else "/"


def entry_info(info: node_api.FileInfo) -> dict[str, Any]:
    """E2B's ``EntryInfo`` (JSON form) of a capsa file info."""
    mode = info.mode & 0o7777
    return {
        "name": info.name, "type": _TYPES.get(info.type, "FILE_TYPE_UNSPECIFIED"), "path": info.path,
        "size": str(info.size), "mode": mode,
        "permissions": statmod.filemode(_MODE_BITS.get(info.type, 0) | mode),
        "owner": "", "group": "",
        "modifiedTime": datetime.fromtimestamp(info.mtime, UTC).isoformat().replace("+00:00", "Z"),
    }


def write_entry(info: node_api.FileInfo) -> dict[str, Any]:
    """One item of the ``/files`` upload answer."""
    return {"name": info.name, "type": "dir" if info.type == "dir" else "file", "path": info.path}


async def stat(control: ControlPlane, target: EnvdTarget, path: str) -> dict[str, Any]:
    info = await relay.call(target.session, lambda node, sandbox: node.stat(sandbox, path))
    return {"entry": entry_info(info)}


async def make_dir(control: ControlPlane, target: EnvdTarget, path: str) -> dict[str, Any]:
    """Create the directory and its parents; one that exists already is ``already_exists`` (the SDK's
    ``make_dir`` then answers False)."""
    try:
        await relay.call(target.session, lambda node, sandbox: node.stat(sandbox, path))
    except ApiError as exc:
        if exc.code != "not_found":
            raise
    else:
        raise ConnectError("already_exists", f"{path} already exists")
    info = await relay.call(target.session, lambda node, sandbox: node.mkdir(sandbox, path, True),
                            audit=relay.Audit("file", "mkdir", lambda _: {"path": path, "parents": True}))
    return {"entry": entry_info(info)}


async def move(control: ControlPlane, target: EnvdTarget, source: str, destination: str) -> dict[str, Any]:
    moved = relay.Audit[node_api.FileInfo]("file", "move",
                                           lambda _: {"path": source, "destination": destination})
    info = await relay.call(target.session, lambda node, sandbox: node.rename(sandbox, source, destination),
                            audit=moved)
    return {"entry": entry_info(info)}


async def remove(control: ControlPlane, target: EnvdTarget, path: str) -> dict[str, Any]:
    await relay.call(target.session, lambda node, sandbox: node.remove(sandbox, path, True),
                     audit=relay.Audit("file", "delete", lambda _: {"path": path, "recursive": True}))
    return {}


async def _walk(control: ControlPlane, target: EnvdTarget, path: str, depth: int, listings: list[int],
                ) -> AsyncIterator[node_api.FileInfo]:
    if listings[0] >= MAX_LISTINGS:
        raise ConnectError("resource_exhausted", (
            f"ListDir would list more than {MAX_LISTINGS} directories; ask for a smaller depth or a "
            "deeper path"))
    listings[0] += 1
    items = await relay.call(target.session, lambda node, sandbox: node.list_dir(sandbox, path))
    for item in items:
        yield item
        if depth > 1 and item.type == "dir":
            async for sub in _walk(control, target, item.path, depth - 1, listings):
                yield sub


async def list_dir(control: ControlPlane, target: EnvdTarget, path: str, depth: object) -> dict[str, Any]:
    levels = 1 if depth in (None, 0) else depth
    if not isinstance(levels, int) or levels < 1:
        raise ConnectError("invalid_argument", "depth must be a positive integer")
    if levels > MAX_DEPTH:
        raise ConnectError("invalid_argument", f"depth is at most {MAX_DEPTH} here")
    entries: list[dict[str, Any]] = []
    async for info in _walk(control, target, path, levels, [0]):
        entries.append(entry_info(info))
        if len(entries) > _MAX_ENTRIES:
            raise ConnectError("resource_exhausted", f"more than {_MAX_ENTRIES} entries")
    return {"entries": entries}

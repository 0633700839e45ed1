"""Watching a directory for changes: Linux inotify through ctypes (standard library only).

``file_watch`` (meta ``path``, optional ``recursive``) answers EVENT {"watching": true} once the watches
are in place, then one DATA frame per batch of changes: JSON lines ``{"type": "created"|"modified"|
"removed", "path": ..., "is_dir": bool}``, in the order the kernel reported them. Consecutive duplicates
(a write in many pieces) are folded into one. A rename is ``removed`` of the old path and ``created`` of
the new one. The watch runs until the host cancels it, or until the watched directory itself is removed
(then RESULT {"reason": "removed"}); ``overflow`` (the kernel queue overflowed: events were lost) is sent
as an event of its own. With ``recursive``, directories created later are watched too (changes inside one
that happen before its watch is added are missed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import select
import struct
from typing import Any

from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.errors import OpError, from_os_error
from capsa.guest.protocol import Kind
from capsa.guest.results import WatchEvent

__all__ = ["MAX_WATCHES", "op_file_watch"]

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_MASK = IN_MODIFY | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
MAX_WATCHES = 8192
"""Directories one recursive watch follows at most (``too_large`` past it)."""

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise from_os_error(OSError(err, os.strerror(err)), what)
    return result


class Watcher:
    """One inotify instance over a directory (and, when recursive, the directories below it)."""

    def __init__(self, path: str, recursive: bool) -> None:
        self.root = path
        self.recursive = recursive
        self.fd = _check(_lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        self.dirs: dict[int, str] = {}
        try:
            self._add(path)
            if recursive:
                for folder, subdirs, _ in os.walk(path):
                    for sub in subdirs:
                        self._add(os.path.join(folder, sub))
        except BaseException:
            os.close(self.fd)
            raise

    def _add(self, path: str) -> None:
        if len(self.dirs) >= MAX_WATCHES:
            raise OpError("too_large", f"more than {MAX_WATCHES} directories to watch under {self.root}")
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), _MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if path != self.root and err in (errno.ENOENT, errno.ENOTDIR):
                return  # gone again before we got to it
            raise from_os_error(OSError(err, os.strerror(err)), path)
        self.dirs[wd] = path

    def close(self) -> None:
        os.close(self.fd)

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """Events read now (maybe none), and whether the root itself is gone."""
        try:
            raw = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return [], False
        events: list[dict[str, Any]] = []
        gone = False
        pos = 0
        while pos + _HEADER.size <= len(raw):
            wd, mask, _cookie, length = _HEADER.unpack_from(raw, pos)
            name = raw[pos + _HEADER.size: pos + _HEADER.size + length].rstrip(b"\0")
            pos += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                events.append(WatchEvent("overflow", self.root, True).to_meta())
                continue
            folder = self.dirs.get(wd)
            if folder is None:
                continue
            if mask & IN_IGNORED:
                del self.dirs[wd]
                gone = gone or folder == self.root
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                gone = gone or folder == self.root
                continue
            path = os.path.join(folder, os.fsdecode(name)) if name else folder
            is_dir = bool(mask & IN_ISDIR)
            if mask & (IN_CREATE | IN_MOVED_TO):
                kind = "created"
                if is_dir and self.recursive:
                    self._add(path)
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                kind = "removed"
            else:
                kind = "modified"
            event = WatchEvent(kind, path, is_dir).to_meta()
            if not events or events[-1] != event or kind != "modified":
                events.append(event)
        return events, gone


def _args(args: dict[str, Any]) -> tuple[str, bool]:
    path = args.get("path")
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise OpError("bad_request", "path must be an absolute path")
    recursive = args.get("recursive", False)
    if not isinstance(recursive, bool):
        raise OpError("bad_request", "recursive must be a boolean")
    if not os.path.exists(path):
        raise OpError("not_found", f"{path}: no such directory")
    if not os.path.isdir(path):
        raise OpError("not_a_directory", f"{path} is not a directory")
    return os.path.normpath(path), recursive


def op_file_watch(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    path, recursive = _args(args)
    watcher = Watcher(path, recursive)
    last: dict[str, Any] | None = None
    try:
        stream.send(Kind.EVENT, {"watching": True, "path": path, "directories": len(watcher.dirs)})
        while not stream.cancelled.is_set():
            ready, _, _ = select.select([watcher.fd], [], [], 0.2)
            if not ready:
                last = None
                continue
            events, gone = watcher.read()
            if last is not None and events and events[0] == last and last["type"] == "modified":
                events = events[1:]
            if events:
                last = events[-1]
                stream.send_data(b"".join(json.dumps(e).encode() + b"\n" for e in events))
            if gone:
                stream.result({"reason": "removed"})
                return
    finally:
        watcher.close()
    raise ChannelGone("watch closed by the host")

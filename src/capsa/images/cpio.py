"""A writer for the ``newc`` cpio format the kernel unpacks as its initramfs.

Written here rather than shelling out to ``cpio`` so the archive can hold a ``/dev/console`` device
node without root, and so it is reproducible: fixed inode numbers, owners and timestamps.
"""

from __future__ import annotations

import stat
from typing import BinaryIO

__all__ = ["CpioWriter"]

_MAGIC = b"070701"
_TRAILER = "TRAILER!!!"


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


class CpioWriter:
    """Append entries to a newc archive; call :meth:`close` to write the trailer.

    Paths are written without a leading slash, as the kernel expects. Parent directories must be
    added before their contents.
    """

    def __init__(self, out: BinaryIO, *, mtime: int = 0) -> None:
        self._out = out
        self._mtime = mtime
        self._ino = 720  # arbitrary start; only uniqueness matters
        self._names: set[str] = set()
        self._closed = False

    def _entry(self, name: str, mode: int, data: bytes = b"", *, rdev: tuple[int, int] = (0, 0),
               nlink: int = 1) -> None:
        if self._closed:
            raise ValueError("cpio archive already closed")
        name = name.lstrip("/")
        if name != _TRAILER:
            if not name or ".." in name.split("/") or "\0" in name:
                raise ValueError(f"invalid cpio member name {name!r}")
            if name in self._names:
                raise ValueError(f"duplicate cpio member {name!r}")
            parent = name.rpartition("/")[0]
            if parent and parent not in self._names:
                raise ValueError(f"parent directory of {name!r} must be added first")
            self._names.add(name)
        encoded = name.encode() + b"\0"
        self._ino += 1
        fields = (self._ino, mode, 0, 0, nlink, self._mtime, len(data), 0, 0, rdev[0], rdev[1],
                  len(encoded), 0)
        header = _MAGIC + b"".join(b"%08X" % f for f in fields)
        self._out.write(header + encoded + _pad4(len(header) + len(encoded)))
        self._out.write(data + _pad4(len(data)))

    def add_dir(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | perm, nlink=2)

    def add_file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def add_symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def add_char_device(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | perm, rdev=(major, minor))

    def close(self) -> None:
        if not self._closed:
            self._entry(_TRAILER, 0, nlink=1)
            self._closed = True

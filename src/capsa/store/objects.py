"""What a store backend is: named objects (bytes or whole files) that can be put, read, listed and deleted.

Keys are ``/``-separated relative names of plain segments (``chunks/ten_x/ab/ab12…``); a key that could
escape a directory backend or name a hidden file is refused with :class:`StoreError` before any backend
sees it. Backends are synchronous (boto3 is); callers on an event loop run them in a thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from capsa.common.errors import CapsaError

__all__ = ["ObjectInfo", "ObjectMissing", "ObjectStore", "StoreError", "check_key"]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=-]{0,127}$")


class StoreError(CapsaError):
    """The store refused or failed an operation (unreachable, denied, a malformed key or object)."""

    code = "store_error"
    status = 502


class ObjectMissing(StoreError):
    code = "store_object_missing"
    status = 404


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float
    """Seconds since the epoch."""


def check_key(key: str) -> str:
    parts = key.split("/")
    if len(parts) > 8 or not all(_SEGMENT.match(p) and ".." not in p for p in parts):
        raise StoreError(f"not a store key: {key!r}")
    return key


class ObjectStore(Protocol):
    url: str
    """Where the store is, for logs and errors (never with credentials)."""

    def put(self, key: str, data: bytes) -> None:
        """Write the object whole; a reader sees the old object or the new one, never a part."""

    def put_file(self, key: str, path: Path) -> None:
        """Write a file's content as the object (in parts when large)."""

    def get(self, key: str) -> bytes:
        """The object's bytes; :class:`ObjectMissing` when there is none."""

    def get_file(self, key: str, path: Path) -> None:
        """Write the object into ``path`` (replaced whole); :class:`ObjectMissing` when there is none."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove the object; no error when it is already gone."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a whole segment path ending in ``/``, or "")."""

    def check(self) -> str:
        """Whether this node can use the store, without changing what it holds; returns what was checked
        (one line), raises :class:`StoreError` saying why not."""

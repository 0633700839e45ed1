"""Directory layouts declared as tables: ``disk = Below("disk.img")`` reads as ``self.root / "disk.img"``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, overload

__all__ = ["Below"]


class Below:
    """A read-only attribute: a fixed name below another path attribute of the owner (``root`` by default).

    The layouts of a VM's working directory and the storage pool each name a handful of entries below
    their root; this keeps each entry to one line of its table. (The image cache keeps its properties:
    every file of ``capsa.images`` is an input of the guest image digest.)"""

    def __init__(self, name: str, *, parent: str = "root") -> None:
        self.name = name
        self.parent = parent

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Below: ...
    @overload
    def __get__(self, obj: object, owner: type[Any]) -> Path: ...

    def __get__(self, obj: object | None, owner: type[Any]) -> Below | Path:
        if obj is None:
            return self
        parent: Path = getattr(obj, self.parent)
        return parent / self.name

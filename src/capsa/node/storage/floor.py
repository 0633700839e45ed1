"""The storage pool's free-space floor: work that would leave the pool with less free space than the floor
is refused with ``storage_full`` (507) before it starts, instead of failing half-way with ENOSPC.

Every tenant's snapshots, paused sessions and running sandboxes share one pool per node; without a floor,
one tenant filling it makes every tenant's next write fail (a guest's disk, a pause, a restore). The floor
is checked against an estimate of what the work may write (a snapshot or a restored sandbox: its RAM
size; see :mod:`capsa.node.agent.snapshots`), not against what it has written so far, so it is a margin and
not an exact reservation: work checked at the same moment can pass together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from capsa.common.errors import CapsaError

__all__ = ["MiB", "SpaceFloor", "StorageFull"]

MiB = 1024 * 1024


class StorageFull(CapsaError):
    """The pool would drop below its free-space floor (HTTP 507 Insufficient Storage)."""

    code = "storage_full"
    status = 507


@dataclass(frozen=True)
class SpaceFloor:
    """``free_bytes`` reads the pool's free space now; ``min_free_bytes`` is what must stay free."""

    free_bytes: Callable[[], int]
    min_free_bytes: int

    def check(self, need_bytes: int, what: str) -> None:
        """Raise :class:`StorageFull` when writing ``need_bytes`` for ``what`` would cross the floor."""
        free = self.free_bytes()
        if free - need_bytes < self.min_free_bytes:
            raise StorageFull(
                f"not enough free space on this node's storage pool for {what}: {free // MiB} MiB free, "
                f"{need_bytes // MiB} MiB needed and {self.min_free_bytes // MiB} MiB kept free "
                "(CAPSA_STORAGE_MIN_FREE_MIB)",
                free_bytes=free, need_bytes=need_bytes, min_free_bytes=self.min_free_bytes)

"""``session.snapshots``: list, take and restore a session's snapshots."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from capsa.sdk.models import SnapshotInfo

if TYPE_CHECKING:
    from capsa.sdk.session import AsyncSession

__all__ = ["AsyncSnapshots"]


class AsyncSnapshots:
    """The snapshots of one session. Rolling snapshots (a policy given at creation) show up here too."""

    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def list(self) -> builtins.list[SnapshotInfo]:
        """Newest first."""
        return await self._session.client.list_snapshots(self._session.id)

    async def create(self) -> SnapshotInfo:
        """Snapshot the running session now; it keeps running."""
        return await self._session.client.create_snapshot(self._session.id)

    async def restore(self, snapshot_id: str) -> None:
        """Roll the session back to ``snapshot_id``: a new sandbox from it replaces the current one
        (a paused session is resumed from it)."""
        self._session.info = await self._session.client.restore_session(self._session.id, snapshot_id)

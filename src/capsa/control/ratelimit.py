"""Per-key fixed-window rate limits kept in the database, so every replica counts the same requests."""

from __future__ import annotations

import time

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError

from capsa.control.errors import RateLimited
from capsa.control.store.db import DbSession
from capsa.control.store.models import RateCounterRow

__all__ = ["hit", "prune"]


async def hit(db: DbSession, key_id: str, bucket: str, limit: int, window: int, cost: int = 1) -> None:
    """Count one request (``cost`` units: a branch into n sessions counts n); raise :class:`RateLimited`
    (with Retry-After) when the window is full."""
    now = time.time()
    start = int(now // window) * window
    for _ in range(3):
        # Increment first: the UPDATE is atomic on every database, a read-then-write would not be.
        result = await db.execute(
            update(RateCounterRow)
            .where(RateCounterRow.key_id == key_id, RateCounterRow.bucket == bucket,
                   RateCounterRow.window_start == start)
            .values(count=RateCounterRow.count + cost)
            .returning(RateCounterRow.count)
        )
        count = result.scalar_one_or_none()
        if count is None:
            try:
                async with db.begin_nested():
                    db.add(RateCounterRow(key_id=key_id, bucket=bucket, window_start=start, count=cost))
                count = cost
            except IntegrityError:
                continue  # another request created the row first: increment it instead
        await db.commit()
        if count > limit:
            raise RateLimited(f"more than {limit} {bucket} requests in {window} s for this key",
                              retry_after=max(1, int(start + window - now + 0.999)))
        return
    raise RateLimited(f"{bucket} rate limit contention", retry_after=1)


async def prune(db: DbSession, older_than: float) -> None:
    await db.execute(delete(RateCounterRow).where(RateCounterRow.window_start < int(older_than)))
    await db.commit()

"""A guest process that counts, for tests that check a session's processes survive a pause, a move or a
branch: it writes each value to a new file and renames it over ``/tmp/counter``.

A snapshot can stop the guest at any instruction. With a plain ``echo $i > /tmp/counter`` it can stop between
the truncation and the write, and the restored file is empty until the shell runs again; a read that comes
first sees nothing (test_fleet_store failed so in CI). ``mv`` replaces the file in one rename, so every
read sees a whole number."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from capsa.sdk import AsyncSession
from capsa.sdk.errors import NotFound
from tests.support.waits import eventually

__all__ = ["COUNTER_FILE", "counter_past", "counter_script", "goes_on", "session_counter"]

COUNTER_FILE = "/tmp/counter"


def counter_script(interval_s: float = 0.2) -> str:
    """A shell loop counting from 1 into :data:`COUNTER_FILE`, one tick every ``interval_s`` seconds."""
    return (f"i=0; while true; do i=$((i+1)); echo $i > {COUNTER_FILE}.new; "
            f"mv {COUNTER_FILE}.new {COUNTER_FILE}; sleep {interval_s}; done")


async def counter_past(read: Callable[[], Awaitable[int]], value: int, *, within: float = 60.0) -> int:
    """The counter once it is past ``value``, read with ``read`` (0 while there is none yet). A bounded
    wait, not a fixed sleep: under TCG on a loaded host a tick may take far longer than its interval."""
    async def past() -> int:
        now = await read()
        return now if now > value else 0

    return await eventually(past, f"the guest's counter past {value}", within=within, every=0.2)


async def session_counter(session: AsyncSession) -> int:
    """The counter of ``session``'s guest, read through the SDK (0 before its first tick)."""
    try:
        return int((await session.files.read(COUNTER_FILE)).strip())
    except NotFound:
        return 0


async def goes_on(read: Callable[[], Awaitable[int]], seen: int) -> None:
    """After a resume, a move or a failover: the counter starts at ``seen`` (its value before the snapshot)
    or later, not from zero, and ticks on."""
    first = await read()
    assert first >= seen, f"the counter restarted: {first} after {seen}"
    await counter_past(read, first)

"""Bounded waits for tests: poll a condition until it holds or a deadline passes, instead of sleeping a fixed
time and hoping the event came (too short on a loaded host: a red test; too long: a slow one; and an
assertion made before the event can pass whether or not the product works)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["eventually"]

T = TypeVar("T")


async def eventually(check: Callable[[], T | Awaitable[T]], what: str | Callable[[], str], *,
                     within: float = 30.0, every: float = 0.05) -> T:
    """Call ``check`` (plain or async) until it returns a truthy value, and return that value; raise
    AssertionError naming ``what`` (or what it returns then) and the last value seen once ``within``
    seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what if isinstance(what, str) else what()}: not within {within} s "
                                 f"(last: {value!r})")
        await asyncio.sleep(every)

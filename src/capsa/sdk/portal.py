"""A private event loop on a background thread, through which the blocking API runs the async one.

This is what keeps the SDK to a single implementation: every blocking method submits the matching coroutine
here and waits for it. Only one loop thread exists per process (re-created after ``fork``). The blocking
classes derive from :class:`Blocking` (and :class:`Closing` when they hold something open).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, Generic, Self, TypeVar

__all__ = ["Blocking", "Closing", "Portal", "get_portal"]

T = TypeVar("T")
A = TypeVar("A")

# After Ctrl-C, how long to let the cancelled coroutine unwind (close its HTTP stream) before returning.
_CANCEL_GRACE = 5.0


class Portal:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="capsa-sdk-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for its result (or exception)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking capsa call was made from inside an output callback of another "
                               "blocking call; use capsa.AsyncSession for nested calls")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt lands here while the coroutine is still running: stop it too, so no
            # request keeps going in the background after the caller gave up.
            if not future.done():
                future.cancel()
                concurrent.futures.wait([future], timeout=_CANCEL_GRACE)
            raise

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` running on the loop thread from another event loop (cancelling this await cancels
        it there too); awaited on the loop thread itself, it simply runs."""
        if threading.current_thread() is self._thread:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Drive an async iterator from blocking code, one item per round trip to the loop."""
        try:
            while True:
                try:
                    yield self.call(_anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                self.call(aclose())


async def _anext(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()


_lock = threading.Lock()
_portal: Portal | None = None
_portal_pid = 0


def get_portal() -> Portal:
    global _portal, _portal_pid
    with _lock:
        if _portal is None or _portal_pid != os.getpid() or not _portal.alive:
            _portal = Portal()
            _portal_pid = os.getpid()
        return _portal


class Blocking(Generic[A]):
    """The blocking twin of an async SDK object: its methods run the async one's (``_inner``) through the
    portal's loop thread (``_portal``)."""

    def __init__(self, inner: A, portal: Portal) -> None:
        self._inner, self._portal = inner, portal


class Closing(ABC):
    """A blocking object that holds something open until :meth:`close`: ``with obj:`` gives ``obj`` and
    closes it when the block ends, however it ends."""

    @abstractmethod
    def close(self) -> object:
        """Release what the object holds."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Calling a node and what its errors become: the one place the control plane catches a
:class:`~capsa.control.nodes.client.NodeError`.

- :func:`attempt`: the call's result, or the node's error as a value (every other helper here, and the
  relay's session calls, :mod:`capsa.control.sessions.relay`, go through it);
- :func:`node_error`: a node error as the API error it answers with (the node's status and ``code``;
  ``node_unreachable`` is 503, a status that is no error 502);
- :func:`node_call`: a call whose failure is the API's answer (``what``: what failed, before the node's
  message);
- :func:`quietly`: a best-effort call (a cleanup the heartbeat or a later pass retries): its failure is
  logged, and answers False;
- :func:`until_lost`: a stream's events, ended by :class:`NodeLost` when the node stops answering
  mid-stream (the answer has begun: an in-band event, no API error).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Collection
from dataclasses import dataclass
from typing import TypeVar

from capsa.control.errors import ApiError
from capsa.control.nodes.client import NodeError

__all__ = ["NodeLost", "attempt", "node_call", "node_error", "quietly", "until_lost"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


async def attempt(call: Awaitable[_T]) -> _T | NodeError:
    """The result of ``call``, or the node's error (other exceptions propagate)."""
    try:
        return await call
    except NodeError as exc:
        return exc


def node_error(exc: NodeError, what: str | None = None) -> ApiError:
    """The API error that answers for ``exc``: same ``code``, the node's status (502 for one that is not
    an error status, 503 for ``node_unreachable``); ``what`` prefixes the message."""
    message = exc.message if what is None else f"{what}: {exc.message}"
    if exc.code == "node_unreachable":
        return ApiError(message, code="node_unreachable", status=503)
    return ApiError(message, code=exc.code, status=exc.status if 400 <= exc.status < 600 else 502)


async def node_call(call: Awaitable[_T], what: str | None = None) -> _T:
    """The result of ``call``; a node error raises its :func:`node_error`."""
    result = await attempt(call)
    if isinstance(result, NodeError):
        raise node_error(result, what) from result
    return result


async def quietly(call: Awaitable[object], what: str, *, fine: Collection[str] = ()) -> bool:
    """Whether ``call`` succeeded (or failed with a code in ``fine``); another node error is logged as
    ``what: error`` and answers False."""
    result = await attempt(call)
    if isinstance(result, NodeError) and result.code not in fine:
        log.warning("%s: %s", what, result)
        return False
    return True


@dataclass(frozen=True)
class NodeLost:
    """The node stopped answering while a stream was being relayed."""

    message: str
    """The node error's message (or the exception's text)."""
    kind: str
    """The exception's type name."""


async def until_lost(events: AsyncIterator[_T], *, also: tuple[type[Exception], ...] = (),
                     ) -> AsyncIterator[_T | NodeLost]:
    """``events``, then one :class:`NodeLost` if the node's error (or one of ``also``) ends them."""
    caught: tuple[type[Exception], ...] = (NodeError, *also)
    try:
        async for event in events:
            yield event
    except caught as exc:
        yield NodeLost(exc.message if isinstance(exc, NodeError) else str(exc), type(exc).__name__)

"""The relay: "as this caller, on this session, call the node", the one way every front end (the ``/v1``
routes, :mod:`capsa.control.sessions.process_io`, the E2B layer) reaches a running session's sandbox.

- :func:`running`: the one session lookup (from then on the request's log lines carry its ``session_id``,
  and its node calls send it to the node): the session (this replica's
  :class:`~capsa.control.sessions.cache.SessionCache`, else the database), the tenant check (another
  tenant's session is ``not_found``), that it runs, and the activity stamp its idle timeout reads;
- :func:`call`, :func:`open_stream` and :func:`download`: a node call on the session's sandbox; a node
  error becomes the API error to answer with (:func:`session_error`: a vanished sandbox pauses or fails
  the session first, the rest is :func:`capsa.control.nodes.calls.node_error`), and the call's
  :class:`Audit` event (:func:`streamed` for uploads) is noted either way;
- :func:`sandbox_lost`: the same decision for a stream that reports its sandbox gone in-band.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import select, update

from capsa.common import logs
from capsa.common.ids import is_id
from capsa.common.wire.audit import AuditKind
from capsa.control.audit import trail as audit_trail
from capsa.control.audit.digest import StreamDigest
from capsa.control.errors import ApiError, InvalidState, NotFound, SessionFailed
from capsa.control.nodes.calls import attempt, node_error
from capsa.control.nodes.client import NodeClient, NodeError
from capsa.control.plane import ControlPlane
from capsa.control.sessions.service import activity_stale, lose_sandbox
from capsa.control.store.db import DbSession
from capsa.control.store.models import NodeRow, SessionRow, utcnow

__all__ = ["SANDBOX_GONE_CODES", "Audit", "SessionTarget", "call", "download", "open_stream", "running",
           "sandbox_lost", "session_error", "streamed"]

SANDBOX_GONE_CODES = frozenset({"sandbox_failed", "sandbox_not_found"})
"""Node error codes meaning the session's VM is gone: the session is paused at its latest snapshot, or
fails."""

_T = TypeVar("_T")
_R = TypeVar("_R", contravariant=True)


@dataclass(frozen=True)
class SessionTarget:
    """A running session as one caller found it: its row, a client for its node, and (for short) the
    session's and its sandbox's ids."""

    plane: ControlPlane
    row: SessionRow
    client: NodeClient
    id: str
    sandbox_id: str


def _target(plane: ControlPlane, row: SessionRow, node: NodeRow) -> SessionTarget:
    """The target; the rest of the request logs (and its node calls carry) the session's id."""
    assert row.sandbox_id is not None  # a running session has one (:func:`_not_running`)
    logs.bind(session_id=row.id)
    return SessionTarget(plane, row, plane.node_client(node), row.id, row.sandbox_id)


async def _load_with_node(db: DbSession, tenant: str | None, session_id: str,
                          ) -> tuple[SessionRow, NodeRow | None]:
    """The session (of ``tenant``; None: of any) and its node, in one query."""
    if not is_id(session_id, "ses"):
        raise NotFound(f"session {session_id} not found")
    found = (await db.execute(
        select(SessionRow, NodeRow).outerjoin(NodeRow, NodeRow.id == SessionRow.node_id)
        .where(SessionRow.id == session_id).execution_options(populate_existing=True))).first()
    # Another tenant's session is indistinguishable from a missing one.
    if found is None or (tenant is not None and found[0].tenant != tenant):
        raise NotFound(f"session {session_id} not found")
    return found[0], found[1]


def _not_running(row: SessionRow, node: NodeRow | None) -> ApiError | None:
    """Why a call cannot go to the session ``row`` (None: it can)."""
    if row.state == "failed":
        return SessionFailed(f"session {row.id} failed: {row.failure_reason}")
    if row.state != "running":
        return InvalidState(f"session {row.id} is {row.state}, not running")
    if node is None or not row.sandbox_id:
        return SessionFailed(f"session {row.id} has no sandbox")
    return None


async def running(plane: ControlPlane, tenant: str | None, session_id: str, *, fresh: bool = False,
                  activity: bool = True) -> SessionTarget:
    """The session, which must be running, and a client for its node.

    A call for a caller (``activity``) records activity for idle timeouts and may take the row from this
    replica's session cache (``fresh``: always read it; it is cached then); a call that fails hands its
    error to :func:`session_error`, which reads the row again when it was cached. ``activity=False``: an
    internal call (snapshots): read fresh, neither cached nor stamped. ``tenant`` None: any tenant's."""
    hit = None if fresh or not activity else plane.sessions.lookup(session_id)
    if hit is not None:
        row, node = hit
        if tenant is not None and row.tenant != tenant:
            raise NotFound(f"session {session_id} not found")
    else:
        async with plane.db() as db:
            row, found = await _load_with_node(db, tenant, session_id)
        if (refused := _not_running(row, found)) is not None:
            raise refused
        assert found is not None
        node = found
        if not activity:
            return _target(plane, row, node)
        plane.sessions.store(row, node)
    now = utcnow()
    if activity_stale(row, now, plane.settings.activity_stamp_interval):
        async with plane.db() as db:
            await db.execute(update(SessionRow).where(SessionRow.id == session_id)
                             .values(last_activity_at=now))
            await db.commit()
        row.last_activity_at = now  # the cached row is this object: the cache sees the stamp too
    return _target(plane, row, node)


async def session_error(target: SessionTarget, exc: NodeError) -> ApiError:
    """The API error for a node call on the session that failed; a vanished sandbox pauses the session
    (with a snapshot to come back to) or fails it.

    When the row may have come from the session cache, it is read again first: a session that left
    ``running`` or moved to another sandbox since gets the error its current state gives, not a loss."""
    plane, row = target.plane, target.row
    if plane.sessions.forget(row.id) and exc.code in SANDBOX_GONE_CODES:
        async with plane.db() as db:
            now, node = await _load_with_node(db, row.tenant, row.id)
        if (refused := _not_running(now, node)) is not None:
            return refused
        if now.sandbox_id != row.sandbox_id:
            return InvalidState(f"session {row.id} moved to another sandbox while the call was on its way; "
                                "send it again")
    if exc.code in SANDBOX_GONE_CODES:
        if await lose_sandbox(plane, row.id, exc.message or exc.code, row.sandbox_id) == "paused":
            return InvalidState(f"session {row.id} lost its sandbox and was paused at its latest snapshot; "
                                f"resume it to continue ({exc.message})")
        return SessionFailed(f"session {row.id} failed: {exc.message}")
    return node_error(exc)


async def sandbox_lost(target: SessionTarget, code: str, detail: str | None) -> tuple[str, str]:
    """A stream reported in-band that the sandbox is gone (``code`` in :data:`SANDBOX_GONE_CODES`): the
    session is paused or failed, and the (code, detail) of the event that ends the stream is returned."""
    state = await lose_sandbox(target.plane, target.id, detail or code, target.row.sandbox_id)
    return ("session_failed" if state == "failed" else "invalid_state",
            f"session {target.id} lost its sandbox ({state}): {detail}")


@dataclass(frozen=True)
class Audit(Generic[_R]):
    """The audit event a relayed call notes with the request's ``api`` event: ``ok`` gives its detail
    from the call's result, ``failed`` from the node's error code (None: a failed call notes nothing)."""

    kind: AuditKind
    action: str
    ok: Callable[[_R], Mapping[str, object]]
    failed: Callable[[str], Mapping[str, object]] | None = None


def streamed(action: str, digest: StreamDigest, path: str, **extra: object) -> Audit[object]:
    """The ``file`` audit event of a streamed upload: its path, size and digest (and ``extra``), or the
    node's error code if it failed."""
    return Audit("file", action, lambda _: digest.detail(path, **extra),
                 lambda code: digest.detail(path, error=code))


async def call(target: SessionTarget, op: Callable[[NodeClient, str], Awaitable[_T]], *,
               audit: Audit[_T] | None = None, instead: Mapping[str, ApiError] | None = None) -> _T:
    """``op(client, sandbox_id)`` on the session's node; a node error raises :func:`session_error`, or
    the error ``instead`` gives for its code."""
    result = await attempt(op(target.client, target.sandbox_id))
    if isinstance(result, NodeError):
        if audit is not None and audit.failed is not None:
            audit_trail.note(audit.kind, audit.action, session_id=target.id, detail=audit.failed(result.code))
        if instead is not None and result.code in instead:
            raise instead[result.code] from None
        raise await session_error(target, result) from result
    if audit is not None:
        audit_trail.note(audit.kind, audit.action, session_id=target.id, detail=audit.ok(result))
    return result


async def open_stream(target: SessionTarget,
                      opener: Callable[[NodeClient, str], AbstractAsyncContextManager[_T]],
                      ) -> tuple[_T, AsyncExitStack]:
    """Open one of the node's streams on the session's sandbox: the stream and the stack that closes it
    (the caller's to close); the node's refusal raises :func:`session_error` here."""
    stack = AsyncExitStack()
    try:
        opened = await attempt(stack.enter_async_context(opener(target.client, target.sandbox_id)))
    except BaseException:
        await stack.aclose()
        raise
    if isinstance(opened, NodeError):
        await stack.aclose()
        raise await session_error(target, opened) from opened
    return opened, stack


async def download(target: SessionTarget,
                   opener: Callable[[NodeClient, str], AbstractAsyncContextManager[AsyncIterator[bytes]]],
                   action: str, path: str) -> tuple[AsyncIterator[bytes], AsyncExitStack]:
    """:func:`open_stream` for a download of ``path``: its chunks, whose ``file`` audit event (path, size,
    digest) is noted when they end, and the stack that closes the node's stream."""
    chunks, stack = await open_stream(target, opener)

    async def noted() -> AsyncIterator[bytes]:
        digest = StreamDigest()
        try:
            async for chunk in digest.through(chunks):
                yield chunk
        finally:
            # Noted before the response's last message, so it is written with the request's api event.
            audit_trail.note("file", action, session_id=target.id, detail=digest.detail(path))
            await stack.aclose()

    return noted(), stack

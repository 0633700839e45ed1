"""The tenant audit chain: appending events, the per-request audit context, reading and verifying.

Every event belongs to one tenant's chain (``audit_trail``), numbered from 1 (its ``id``) and carrying the
hash of the tenant's previous event (:mod:`capsa.common.audit_chain`). Appends are serialized per tenant
by the tenant's ``audit_heads`` row, locked (an upsert ``... ON CONFLICT DO UPDATE ... RETURNING``: a row
lock on PostgreSQL, the database write lock on SQLite) and updated in the same transaction as the
inserts, so replicas and concurrent requests append one after another and never fork the chain.

Two ways in:

- :func:`record` / :func:`append` add events inside the caller's database transaction (the caller
  commits): the event exists exactly when the change it describes does. :func:`write` is the same in a
  transaction of its own.
- :func:`note` adds an event to the current API request (:class:`RequestAudit`, set by
  :mod:`capsa.control.audit.middleware`); the middleware writes the request's ``api`` event and every noted
  event in one transaction just before the response's last byte goes out. This keeps the cost per API
  call to one small transaction.

Both fill ``request_id`` and ``key_id`` from the current request when not given.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from capsa.common.audit_chain import GENESIS, ChainFields, event_hash, normalize_detail
from capsa.common.audit_checkpoint import Checkpoint
from capsa.common.wire.audit import AuditKind
from capsa.control.store.audit_models import AuditHeadRow, AuditTrailRow
from capsa.control.store.db import DbSession

__all__ = [
    "AuditEntry",
    "BreakCode",
    "ChainBreak",
    "Executor",
    "RequestAudit",
    "VerifyResult",
    "append",
    "append_sync",
    "bind",
    "current",
    "identify",
    "iter_chain",
    "list_events",
    "note",
    "note_error",
    "record",
    "row_fields",
    "unbind",
    "verify",
    "write",
]


@dataclass
class AuditEntry:
    """An event before it is chained: ``time`` in seconds since the epoch (now when None)."""

    kind: AuditKind
    action: str
    session_id: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    key_id: str | None = None
    request_id: str | None = None
    time: float | None = None


@dataclass
class RequestAudit:
    """One API request's audit context: its id, its caller once authenticated, and the events noted."""

    request_id: str
    tenant: str | None = None
    key_id: str | None = None
    session_id: str | None = None
    error_code: str | None = None
    events: list[AuditEntry] = field(default_factory=list)


_current: contextvars.ContextVar[RequestAudit | None] = contextvars.ContextVar("capsa_request_audit",
                                                                               default=None)


def current() -> RequestAudit | None:
    return _current.get()


def bind(context: RequestAudit) -> contextvars.Token[RequestAudit | None]:
    """Make ``context`` the current request's (the middleware's job)."""
    return _current.set(context)


def unbind(token: contextvars.Token[RequestAudit | None]) -> None:
    _current.reset(token)


def identify(tenant: str, key_id: str) -> None:
    """The current request's caller is authenticated (called by ``capsa.control.auth.authenticate``)."""
    context = _current.get()
    if context is not None:
        context.tenant, context.key_id = tenant, key_id


def note_error(code: str) -> None:
    """The problem code the current request answers with (the ``api`` event's ``code``)."""
    context = _current.get()
    if context is not None:
        context.error_code = code


def note(kind: AuditKind, action: str, *, session_id: str | None = None,
         detail: Mapping[str, Any] | None = None) -> bool:
    """Add an event to the current authenticated request, written with its ``api`` event. False (and
    nothing recorded) outside a request or before authentication: use :func:`record` there."""
    context = _current.get()
    if context is None or context.tenant is None:
        return False
    if session_id and context.session_id is None:
        context.session_id = session_id
    context.events.append(AuditEntry(kind, action, session_id=session_id, detail=dict(detail or {}),
                                     key_id=context.key_id, request_id=context.request_id))
    return True


Executor = DbSession | AsyncConnection
"""What appends run on: an ORM session (the caller's transaction) or a Core connection."""


def _dialect(db: Executor) -> str:
    return db.dialect.name if isinstance(db, AsyncConnection) else db.get_bind().dialect.name


def _lock_head_statement(insert_fn: Any) -> Any:
    stmt = insert_fn(AuditHeadRow).values(tenant=bindparam("head_tenant"), seq=0, hash=GENESIS)
    return stmt.on_conflict_do_update(index_elements=["tenant"], set_={"seq": AuditHeadRow.seq}) \
        .returning(AuditHeadRow.seq, AuditHeadRow.hash)


# Built once: constructing these statements (and their cache keys) on every append cost more host time
# than the database did for a single event. The tenant and the new head go in as parameters.
_LOCK_HEAD = {"postgresql": _lock_head_statement(pg_insert), "sqlite": _lock_head_statement(sqlite_insert)}
_INSERT_EVENTS = insert(AuditTrailRow)
_MOVE_HEAD = update(AuditHeadRow).where(AuditHeadRow.tenant == bindparam("head_tenant")) \
    .values(seq=bindparam("head_seq"), hash=bindparam("head_hash"))


def _lock_head(db: Executor) -> Any:
    """One statement that creates the tenant's head if missing, locks it and returns it: an upsert whose
    conflict branch rewrites the row unchanged. On PostgreSQL ``ON CONFLICT DO UPDATE`` locks the row
    like ``SELECT ... FOR UPDATE``; on SQLite any write takes the database's write lock (waiting out other
    writers), so the head read cannot be stale. Its parameter: ``head_tenant``."""
    return _LOCK_HEAD["postgresql" if _dialect(db) == "postgresql" else "sqlite"]


def _chain(tenant: str, seq: int, prev: str, entries: Sequence[AuditEntry]
           ) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The rows that chain ``entries`` after the head (``seq``, ``prev``), and their (id, hash)."""
    context = _current.get()
    now = time.time()
    rows: list[dict[str, Any]] = []
    out: list[tuple[int, str]] = []
    for entry in entries:
        seq += 1
        request_id = entry.request_id if entry.request_id is not None else (
            context.request_id if context is not None else None)
        key_id = entry.key_id if entry.key_id is not None else (
            context.key_id if context is not None and context.tenant == tenant else None)
        fields = ChainFields(tenant=tenant, seq=seq, time_us=int((entry.time or now) * 1_000_000),
                             kind=entry.kind, action=entry.action, key_id=key_id, request_id=request_id,
                             session_id=entry.session_id, detail=normalize_detail(entry.detail),
                             prev_hash=prev)
        digest = event_hash(fields)
        rows.append({**fields.__dict__, "detail": dict(fields.detail), "hash": digest})
        out.append((seq, digest))
        prev = digest
    return rows, out


def _move_head(tenant: str, out: list[tuple[int, str]]) -> dict[str, Any]:
    seq, digest = out[-1]
    return {"head_tenant": tenant, "head_seq": seq, "head_hash": digest}


async def append(db: Executor, tenant: str, entries: Sequence[AuditEntry]) -> list[tuple[int, str]]:
    """Chain ``entries`` onto the tenant's stream inside the caller's transaction; returns (id, hash) of
    each. The tenant's head stays locked until the caller commits or rolls back."""
    if not entries:
        return []
    seq, prev = (await db.execute(_lock_head(db), {"head_tenant": tenant})).one()
    rows, out = _chain(tenant, seq, prev, entries)
    await db.execute(_INSERT_EVENTS, rows)  # executemany: one compiled (cached) statement
    await db.execute(_MOVE_HEAD, _move_head(tenant, out))
    return out


def append_sync(conn: Connection, tenant: str, entries: Sequence[AuditEntry]) -> list[tuple[int, str]]:
    """:func:`append` on a synchronous connection (the audit writer's SQLite thread)."""
    if not entries:
        return []
    dialect = "postgresql" if conn.dialect.name == "postgresql" else "sqlite"
    seq, prev = conn.execute(_LOCK_HEAD[dialect], {"head_tenant": tenant}).one()
    rows, out = _chain(tenant, seq, prev, entries)
    conn.execute(_INSERT_EVENTS, rows)
    conn.execute(_MOVE_HEAD, _move_head(tenant, out))
    return out


async def record(db: Executor, *, tenant: str, kind: AuditKind, action: str, key_id: str | None = None,
                 request_id: str | None = None, session_id: str | None = None,
                 detail: Mapping[str, Any] | None = None, time: float | None = None) -> int:
    """Append one event inside the caller's transaction (the caller commits); returns its id."""
    ((seq, _),) = await append(db, tenant, [AuditEntry(kind, action, session_id=session_id,
                                                       detail=dict(detail or {}), key_id=key_id,
                                                       request_id=request_id, time=time)])
    return seq


async def write(engine: AsyncEngine, tenant: str, entries: Sequence[AuditEntry]) -> list[tuple[int, str]]:
    """Append ``entries`` in a transaction of their own (a Core connection: no ORM session to build)."""
    async with engine.begin() as conn:
        return await append(conn, tenant, entries)


def row_fields(row: AuditTrailRow) -> ChainFields:
    return ChainFields(tenant=row.tenant, seq=row.seq, time_us=row.time_us, kind=row.kind,
                       action=row.action, key_id=row.key_id, request_id=row.request_id,
                       session_id=row.session_id, detail=row.detail, prev_hash=row.prev_hash)


async def iter_chain(db: DbSession, tenant: str, batch: int = 2000) -> AsyncIterator[AuditTrailRow]:
    """The tenant's events in order, read in batches."""
    after = 0
    while True:
        rows = list((await db.execute(select(AuditTrailRow).where(AuditTrailRow.tenant == tenant,
                                                                  AuditTrailRow.seq > after)
                                      .order_by(AuditTrailRow.seq).limit(batch))).scalars())
        for row in rows:
            yield row
        if len(rows) < batch:
            return
        after = rows[-1].seq


async def list_events(db: DbSession, tenant: str, *, session_id: str | None = None,
                      kinds: Sequence[str] = (), since: float | None = None, until: float | None = None,
                      after: int = 0, limit: int = 100) -> list[AuditTrailRow]:
    """A page of the tenant's events (oldest first) after id ``after``, filtered; ``since``/``until`` in
    seconds since the epoch (``since`` inclusive, ``until`` exclusive)."""
    query = select(AuditTrailRow).where(AuditTrailRow.tenant == tenant, AuditTrailRow.seq > after)
    if session_id is not None:
        query = query.where(AuditTrailRow.session_id == session_id)
    if kinds:
        query = query.where(AuditTrailRow.kind.in_(list(kinds)))
    if since is not None:
        query = query.where(AuditTrailRow.time_us >= int(since * 1_000_000))
    if until is not None:
        query = query.where(AuditTrailRow.time_us < int(until * 1_000_000))
    return list((await db.execute(query.order_by(AuditTrailRow.seq).limit(limit))).scalars())


BreakCode = Literal["audit_chain_broken", "audit_chain_truncated"]


@dataclass(frozen=True)
class ChainBreak:
    id: int
    """The first event that does not check out (or is missing)."""
    reason: str
    code: BreakCode = "audit_chain_broken"
    """``audit_chain_truncated``: the chain ends before (or no longer holds) what a signed checkpoint
    vouches for: its tail was cut or the tenant's chain deleted; ``audit_chain_broken``: anything else."""


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    head: int
    """The chain head's id (0: no events)."""
    broken: ChainBreak | None = None
    anchor: int | None = None
    """The highest event a signed checkpoint vouches for (None: no checkpoint was compared)."""


def _first_link(first: int, anchors: Sequence[Checkpoint]) -> tuple[str | None, int]:
    """The ``prev_hash`` the first stored event (``first``) must carry, and the first id that must be
    stored: 64 zeros for event 1, else the hash a ``retention`` checkpoint signed when it dropped the
    events before it (None: no checkpoint vouches for their removal)."""
    if first == 1:
        return GENESIS, 1
    dropped = [a for a in anchors if a.purpose == "retention"]
    for anchor in dropped:
        if anchor.seq == first - 1:
            return anchor.hash, first
    return None, max((a.seq for a in dropped if a.seq < first), default=0) + 1


async def verify(db: DbSession, tenant: str, anchors: Sequence[Checkpoint] = ()) -> VerifyResult:
    """Recompute the tenant's chain: ids consecutive from 1 (or from just after the newest ``retention``
    checkpoint, which vouches for the dropped events), each ``prev_hash`` the previous ``hash``, each
    ``hash`` that of the event's content, the head naming the last event, and every signed checkpoint in
    ``anchors`` (the tenant's, already checked) matching the stored event it names: a chain that ends
    before the highest one was cut (``audit_chain_truncated``)."""
    pinned = {a.seq: a for a in anchors if a.seq > 0}
    top = max(anchors, key=lambda a: (a.seq, a.n), default=None)
    anchor = top.seq if top is not None else None
    expected, prev, checked = 1, GENESIS, 0
    first = True
    async for row in iter_chain(db, tenant):
        if first:
            first = False
            link, start = _first_link(row.seq, anchors)
            if link is None:
                reason = (f"event {start} is missing (the first stored event is {row.seq}, and no "
                          "checkpoint vouches for dropping the ones before it)")
                return VerifyResult(checked, row.seq, ChainBreak(start, reason), anchor)
            expected, prev = row.seq, link
        if row.seq != expected:
            return VerifyResult(checked, row.seq, ChainBreak(expected, f"event {expected} is missing "
                                                             f"(the next stored event is {row.seq})"), anchor)
        if row.prev_hash != prev:
            return VerifyResult(checked, row.seq, ChainBreak(row.seq, "prev_hash does not match the hash "
                                                             f"of event {row.seq - 1}"), anchor)
        if event_hash(row_fields(row)) != row.hash:
            return VerifyResult(checked, row.seq, ChainBreak(row.seq, "hash does not match the event's "
                                                             "content (edited)"), anchor)
        pin = pinned.get(row.seq)
        if pin is not None and pin.hash != row.hash:
            return VerifyResult(checked, row.seq, ChainBreak(row.seq, f"event {row.seq} is not the one "
                                                             f"signed checkpoint {pin.n} vouches for (the "
                                                             "chain was rewritten)"), anchor)
        checked += 1
        expected, prev = row.seq + 1, row.hash
    last = expected - 1
    if top is not None and top.seq > last:
        stamp = datetime.fromtimestamp(top.time_us / 1_000_000, UTC).isoformat(timespec="seconds")
        what = f"the chain ends at event {last}" if last else "the tenant's chain is gone"
        reason = (f"events {last + 1} to {top.seq} are missing: signed checkpoint {top.n} ({stamp}) "
                  f"vouches for event {top.seq} but {what} (its tail was cut)")
        return VerifyResult(checked, last, ChainBreak(last + 1, reason, "audit_chain_truncated"), anchor)
    head = (await db.execute(select(AuditHeadRow.seq, AuditHeadRow.hash)
                             .where(AuditHeadRow.tenant == tenant))).one_or_none()
    if head is None:
        if last:
            return VerifyResult(checked, last, ChainBreak(last, "the chain's head record is missing"), anchor)
        return VerifyResult(0, 0, None, anchor)
    head_seq, head_hash = int(head[0]), str(head[1])
    if head_seq > last:
        return VerifyResult(checked, head_seq, ChainBreak(last + 1, f"event {last + 1} is missing (the "
                                                          f"chain's head is event {head_seq})"), anchor)
    if head_seq < last:
        return VerifyResult(checked, head_seq, ChainBreak(head_seq + 1, f"event {head_seq + 1} is past "
                                                          "the chain's recorded head"), anchor)
    if head_hash != prev:
        return VerifyResult(checked, head_seq, ChainBreak(head_seq, "the chain's head hash does not "
                                                          f"match event {head_seq}"), anchor)
    return VerifyResult(checked, head_seq, None, anchor)

"""Egress control in the control plane: the secrets store, session policies and the audit trail.

Secret values are sealed at rest (:mod:`capsa.control.secretbox`) and leave the control plane only towards
the node running a session whose policy binds them, in the sandbox-create or policy-update call. Audit
events are pulled from nodes (after a sandbox ends and whenever a session's trail is read) and kept here.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from capsa.common.destinations import DestinationRefused, ResolveError, screen_host
from capsa.common.ids import new_id
from capsa.common.node_api import AuditEvent as NodeAuditEvent
from capsa.common.placeholders import new_placeholder
from capsa.common.wire.audit import AuditKind
from capsa.common.wire.egress import AuditEventOut, AuditList, PolicyOut, SecretList, SecretOut
from capsa.control.audit.trail import AuditEntry
from capsa.control.audit.trail import append as audit_append
from capsa.control.connections.tokens import resolve_connections
from capsa.control.egress.grants import tenant_networks
from capsa.control.egress.schemas import SecretCreate
from capsa.control.errors import ApiError, NotFound, ValidationFailed
from capsa.control.nodes.calls import quietly
from capsa.control.nodes.client import EgressArgs, NodeClient, NodeError
from capsa.control.plane import ControlPlane
from capsa.control.secretbox import SecretSealer
from capsa.control.sessions.rows import load_session
from capsa.control.store.db import DbSession
from capsa.control.store.egress_models import (
    AuditCursorRow,
    AuditDroppedRow,
    AuditEventRow,
    SecretRow,
    SessionPolicyRow,
)
from capsa.control.store.models import NodeRow, SessionRow, utcnow
from capsa.control.store.named import add_named, by_ref, list_named

__all__ = [
    "assign_placeholders",
    "collect_audit",
    "collect_audit_quietly",
    "create_secret",
    "delete_secret",
    "get_policy",
    "list_audit",
    "list_secrets",
    "merge_patch",
    "resolve_policy",
    "session_egress",
    "store_policy",
]

log = logging.getLogger(__name__)

_AUDIT_PAGE = 1000


def _sealer(plane: ControlPlane) -> SecretSealer:
    sealer = SecretSealer.from_settings(plane.settings)
    if sealer is None:
        raise ApiError("secrets are not configured on this control plane (set CAPSA_SECRET_KEY or "
                       "CAPSA_SECRET_KEY_FILE)", code="secrets_unavailable", status=503)
    return sealer


def _secret_out(row: SecretRow) -> SecretOut:
    return SecretOut(id=row.id, name=row.name, description=row.description, created_at=row.created_at)


# -- secrets ---------------------------------------------------------------------------------------------

async def create_secret(plane: ControlPlane, tenant: str, body: SecretCreate) -> SecretOut:
    sealer = _sealer(plane)
    secret_id = new_id("sec")
    row = SecretRow(id=secret_id, tenant=tenant, name=body.name, description=body.description,
                    ciphertext=sealer.seal(tenant, secret_id, body.value.get_secret_value()),
                    created_at=utcnow())
    async with plane.db() as db:
        await add_named(db, row, "secret")
    return _secret_out(row)


async def list_secrets(plane: ControlPlane, tenant: str) -> SecretList:
    return SecretList(items=await list_named(plane.db, SecretRow, tenant, _secret_out))


async def _find_secret(db: DbSession, tenant: str, ref: str) -> SecretRow | None:
    return await db.scalar(by_ref(SecretRow, tenant, ref, "sec"))


async def delete_secret(plane: ControlPlane, tenant: str, ref: str) -> None:
    """Running sessions that bind the secret keep the node's copy until they end."""
    async with plane.db() as db:
        row = await _find_secret(db, tenant, ref)
        if row is None:
            raise NotFound(f"secret {ref} not found")
        await db.execute(delete(SecretRow).where(SecretRow.id == row.id))
        await db.commit()


# -- policies --------------------------------------------------------------------------------------------

async def resolve_policy(plane: ControlPlane, tenant: str, policy: Mapping[str, Any]
                         ) -> tuple[dict[str, Any], dict[str, str]]:
    """The policy with every secret reference (name or id) turned into the tenant's secret id, and the
    values of those secrets (decrypted, for the node only)."""
    document = dict(policy)
    bindings = [dict(b) for b in document.get("secrets", [])]
    values: dict[str, str] = {}
    if bindings:
        sealer = _sealer(plane)
        async with plane.db() as db:
            for binding in bindings:
                row = await _find_secret(db, tenant, str(binding["secret"]))
                if row is None:
                    raise ValidationFailed(f"secret {binding['secret']!r} not found",
                                           [{"field": "body.policy.secrets",
                                             "message": f"unknown secret {binding['secret']!r}"}])
                binding["secret"] = row.id
                values[row.id] = sealer.open(tenant, row.id, row.ciphertext)
        document["secrets"] = bindings
    await resolve_connections(plane, tenant, document)
    if document.get("approval_webhook"):
        await _check_webhook(plane, str(document["approval_webhook"]))
    return document, values


async def _check_webhook(plane: ControlPlane, url: str) -> None:
    """Refuse a webhook on (or resolving to) a non-public address outside ``CAPSA_WEBHOOK_ALLOW_NETWORKS``
    before anything is started; the node screens it again (and pins it) for every notification."""
    try:
        await screen_host(urlsplit(url).hostname or "", plane.resolver, plane.settings.webhook_allow_networks)
    except ResolveError:
        return  # not resolvable from here: the node decides when it sends
    except DestinationRefused as exc:
        raise ApiError(f"approval_webhook refused: {exc.message}", code=exc.code, status=exc.status) from None


def assign_placeholders(policy: Mapping[str, Any], previous: Mapping[str, str] | None = None
                        ) -> dict[str, str]:
    """The session's placeholders for ``policy`` (secret id -> placeholder): a secret it had one for
    keeps it (``previous``), a new one gets a random placeholder. The control plane's record is what every
    start of the session's sandboxes sends (create, resume, restore, branch), so a guest restored from a
    snapshot keeps using the placeholders it holds; a branch starts with a copy of its parent's."""
    previous = previous or {}
    out: dict[str, str] = {}
    for binding in policy.get("secrets", []):
        secret_id = str(binding["secret"])
        if secret_id not in out:
            out[secret_id] = previous.get(secret_id) or new_placeholder()
    return out


def store_policy(db: DbSession, session_id: str, policy: dict[str, Any],
                 placeholders: dict[str, str] | None = None) -> None:
    db.add(SessionPolicyRow(session_id=session_id, policy=policy, updated_at=utcnow(),
                            placeholders=placeholders if placeholders is not None
                            else assign_placeholders(policy)))


async def session_egress(plane: ControlPlane, tenant: str, session_id: str) -> EgressArgs | None:
    """What a new sandbox of the session is started with: its current policy, the values of the secrets
    it binds and its placeholders; None for a session without a policy. A session recorded before
    placeholders were (migration 0006) gets them now, and keeps them."""
    async with plane.db() as db:
        row = await db.get(SessionPolicyRow, session_id, populate_existing=True)
        if row is None:
            return None
        policy, recorded = dict(row.policy), dict(row.placeholders or {})
    document, values = await resolve_policy(plane, tenant, policy)
    placeholders = assign_placeholders(document, recorded)
    if placeholders != recorded:
        async with plane.db() as db:
            stored = await db.get(SessionPolicyRow, session_id, populate_existing=True)
            if stored is not None:
                stored.placeholders = placeholders
                await db.commit()
    return EgressArgs(document, values, placeholders, session_id, await tenant_networks(plane, tenant))



async def get_policy(plane: ControlPlane, tenant: str, session_id: str) -> PolicyOut:
    async with plane.db() as db:
        await load_session(db, tenant, session_id)
        row = await db.get(SessionPolicyRow, session_id, populate_existing=True)
    return PolicyOut(session_id=session_id, policy=row.policy if row else None,
                     updated_at=row.updated_at if row else None)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# -- audit -----------------------------------------------------------------------------------------------

async def _cursor(db: DbSession, node_id: str) -> tuple[str | None, int]:
    row = await db.get(AuditCursorRow, node_id, populate_existing=True)
    return (row.node_epoch, row.node_seq) if row is not None else (None, 0)


def _insert(plane: ControlPlane) -> Any:
    return pg_insert if plane.engine.dialect.name == "postgresql" else sqlite_insert


def _insert_ignoring_duplicates(plane: ControlPlane, rows: list[dict[str, Any]]) -> Any:
    # Two replicas may collect the same page at once; the (node, epoch, seq) key keeps one copy.
    return _insert(plane)(AuditEventRow).values(rows).on_conflict_do_nothing()


def _set_cursor(plane: ControlPlane, node_id: str, epoch: str, seq: int) -> Any:
    # A replica writing a lower seq than another's makes the next collection read a page again: harmless,
    # the events' unique key drops the copies.
    stmt = _insert(plane)(AuditCursorRow).values(node_id=node_id, node_epoch=epoch, node_seq=seq)
    return stmt.on_conflict_do_update(index_elements=["node_id"],
                                      set_={"node_epoch": epoch, "node_seq": seq})


def _record_dropped(plane: ControlPlane, rows: list[dict[str, Any]]) -> Any:
    # Counts are cumulative per node process: keeping the larger figure is right whichever replica is late.
    stmt = _insert(plane)(AuditDroppedRow).values(rows)
    larger = func.greatest if plane.engine.dialect.name == "postgresql" else func.max
    return stmt.on_conflict_do_update(index_elements=["session_id", "node_id", "node_epoch"],
                                      set_={"count": larger(AuditDroppedRow.count, stmt.excluded.count)})


async def collect_audit(plane: ControlPlane, node: NodeRow, client: NodeClient | None = None,
                        max_pages: int | None = None) -> int:
    """Copy the node's new audit events into the audit table; returns how many were new to us.

    At most ``max_pages`` pages (``audit_pages_per_collection``) per call: the rest waits for the next one.
    Events are filed only for sessions placed on this node: a node (or a leaked node credential) cannot
    write rows into another node's sessions' trails; what it names otherwise is skipped, and the cursor
    still moves past it.
    """
    client = client or plane.node_client(node)
    pages = max_pages if max_pages is not None else plane.settings.audit_pages_per_collection
    added = 0
    for number in range(pages):
        async with plane.db() as db:
            epoch, after = await _cursor(db, node.id)
        page = await client.audit(after=after, epoch=epoch, limit=_AUDIT_PAGE)
        if page.lost and number == 0:
            log.warning("node %s dropped %d audit events before they were collected", node.id, page.lost)
        items = page.items
        if items:
            # The API events this replica answered before (a session's create) go into the chains first:
            # the node's events followed them.
            await plane.audit.flush()
        named = {i.session_id for i in items if i.session_id} | (set(page.dropped) if number == 0 else set())
        async with plane.db() as db:
            placed = {sid: tenant for sid, tenant in (await db.execute(
                select(SessionRow.id, SessionRow.tenant).where(
                    SessionRow.id.in_(named), SessionRow.node_id == node.id))).all()} if named else {}
            now = time.time()
            rows: list[dict[str, Any]] = [{
                **i.model_dump(exclude={"seq", "detail", "request_id"}), "tenant": placed[i.session_id],
                "node_id": node.id,
                "node_epoch": page.epoch, "node_seq": i.seq,
                # The node's clock, but never in the future: retention by age must be able to reach it.
                "time": min(i.time, now),
            } for i in items if i.session_id in placed]
            if len(rows) < len(items):
                log.warning("node %s reported %d audit events of sessions not placed on it; ignored",
                            node.id, len(items) - len(rows))
            if rows:
                # Only the rows this call inserted go into the tenant chains: a replica collecting the
                # same page at once inserts (and chains) none of them twice.
                fresh = set((await db.execute(_insert_ignoring_duplicates(plane, rows)
                                              .returning(AuditEventRow.node_seq))).scalars())
                await _chain_egress(db, node.id, page.epoch, [i for i in items if i.seq in fresh],
                                    placed, now)
            dropped = [{"session_id": sid, "node_id": node.id, "node_epoch": page.epoch,
                        "count": min(max(0, n), 1 << 62)}
                       for sid, n in sorted(page.dropped.items()) if number == 0 and sid in placed]
            if dropped:
                await db.execute(_record_dropped(plane, dropped))
            seq = items[-1].seq if items else page.last_seq
            await db.execute(_set_cursor(plane, node.id, page.epoch, seq))
            await db.commit()
            added += len(rows)
        if len(items) < _AUDIT_PAGE:
            break
    return added


_CHAIN_KINDS: dict[str, AuditKind] = {"approval": "approval", "connection": "connection"}


async def _chain_egress(db: DbSession, node_id: str, epoch: str, items: list[NodeAuditEvent],
                        placed: Mapping[str, str], now: float) -> None:
    by_tenant: dict[str, list[AuditEntry]] = {}
    for item in items:
        if item.session_id is None or item.session_id not in placed:
            continue
        kind: AuditKind = _CHAIN_KINDS.get(item.kind, "egress")
        detail: dict[str, Any] = item.model_dump(exclude={"seq", "session_id", "time", "detail",
                                                          "request_id"})
        detail.update(node_id=node_id, node_epoch=epoch, node_seq=item.seq)
        action = item.kind
        if item.detail:
            detail["detail"] = item.detail
            named = item.detail.get("action")
            action = named if isinstance(named, str) and named and kind != "egress" else item.kind
        by_tenant.setdefault(placed[item.session_id], []).append(AuditEntry(
            kind, action[:64], session_id=item.session_id, detail=detail, request_id=item.request_id,
            time=min(item.time, now)))
    for tenant in sorted(by_tenant):  # one lock order for every replica: no deadlock between them
        await audit_append(db, tenant, by_tenant[tenant])


async def collect_audit_quietly(plane: ControlPlane, node: NodeRow) -> None:
    """Collect, logging instead of raising: a session ending must not fail over its audit copy (the events
    stay on the node and the next collection takes them)."""
    try:
        await collect_audit(plane, node)
    except (NodeError, KeyError, ValueError) as exc:
        log.warning("could not collect audit events from node %s: %s", node.id, exc)


def _encode(value: int) -> str:
    return base64.urlsafe_b64encode(str(value).encode()).decode().rstrip("=")


def _decode(cursor: str) -> int:
    try:
        return int(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode())
    except (ValueError, UnicodeDecodeError):
        raise ValidationFailed("invalid cursor", [{"field": "query.cursor", "message": "invalid cursor"}]) \
            from None


async def list_audit(plane: ControlPlane, tenant: str, session_id: str, limit: int, cursor: str | None,
                     decision: str | None = None) -> AuditList:
    """A session's egress audit trail, oldest first; new events are fetched from its node first."""
    async with plane.db() as db:
        session = await load_session(db, tenant, session_id)
        node = await db.get(NodeRow, session.node_id) if session.node_id else None
    if node is not None:
        await quietly(collect_audit(plane, node), f"could not collect audit events from node {node.id}")
    query = select(AuditEventRow).where(AuditEventRow.tenant == tenant,
                                        AuditEventRow.session_id == session_id)
    if decision is not None:
        query = query.where(AuditEventRow.decision == decision)
    if cursor:
        query = query.where(AuditEventRow.id > _decode(cursor))
    async with plane.db() as db:
        rows = list((await db.execute(query.order_by(AuditEventRow.id).limit(limit + 1))).scalars())
        dropped = await db.scalar(select(func.coalesce(func.sum(AuditDroppedRow.count), 0))
                                  .where(AuditDroppedRow.session_id == session_id))
    page, more = rows[:limit], len(rows) > limit
    items = [AuditEventOut(
        id=r.id, session_id=r.session_id, sandbox_id=r.sandbox_id, time=datetime.fromtimestamp(r.time, UTC),
        kind=r.kind, decision=r.decision, source=r.source,
        destination=r.destination, resolved_ip=r.resolved_ip, method=r.method, path=r.path, status=r.status,
        bytes_out=r.bytes_out, bytes_in=r.bytes_in, rule=r.rule, reason=r.reason, secret_ids=r.secret_ids,
        count=r.count) for r in page]
    return AuditList(items=items, next_cursor=_encode(page[-1].id) if more and page else None,
                     dropped=int(dropped or 0))

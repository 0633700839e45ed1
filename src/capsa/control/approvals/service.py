"""Approvals in the control plane: a tenant's held egress requests, found on the nodes running its sessions,
and decisions sent to them (naming the API key that decided).

Nodes keep approvals in memory only while the request is held (and a short while after): there is no table
here. A tenant sees and decides only approvals of its own sessions: the node is asked for approvals of the
caller's sessions, and a decision names the session the approval must belong to.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import UTC, datetime

from sqlalchemy import select

from capsa.common.ids import is_id
from capsa.common.node_api import ApprovalDecision, ApprovalInfo
from capsa.common.wire.approvals import ApprovalList, ApprovalOut
from capsa.control.approvals.schemas import ApprovalDecisionIn
from capsa.control.auth import Principal
from capsa.control.errors import ApprovalDecided, ApprovalNotFound
from capsa.control.nodes.calls import attempt
from capsa.control.nodes.client import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.store.models import NodeRow, SessionRow

__all__ = ["decide", "get_approval", "list_approvals"]

log = logging.getLogger(__name__)


def _approval_out(info: ApprovalInfo, session_id: str) -> ApprovalOut:
    """A node's held request as the tenant sees it: under its session, times as datetimes."""
    def when(t: float | None) -> datetime | None:
        return datetime.fromtimestamp(t, UTC) if t is not None else None

    return ApprovalOut(id=info.id, session_id=session_id, destination=info.destination, method=info.method,
                       path=info.path, rule=info.rule, approval_rule=info.approval_rule, scope=info.scope,
                       preview=info.preview, body_bytes=info.body_bytes,
                       created_at=datetime.fromtimestamp(info.created_at, UTC),
                       expires_at=datetime.fromtimestamp(info.expires_at, UTC), state=info.state,
                       decided_by=info.decided_by, decided_at=when(info.decided_at), reason=info.reason)


async def _placed(plane: ControlPlane, tenant: str, session_id: str | None, *, running: bool
                  ) -> dict[str, tuple[NodeRow, list[str]]]:
    """node id -> (node, the tenant's sessions placed on it)."""
    query = select(SessionRow.id, SessionRow.node_id).where(SessionRow.tenant == tenant,
                                                           SessionRow.node_id.is_not(None))
    if running:
        query = query.where(SessionRow.state == "running")
    if session_id is not None:
        query = query.where(SessionRow.id == session_id)
    groups: dict[str, list[str]] = defaultdict(list)
    async with plane.db() as db:
        for sid, node_id in (await db.execute(query)).all():
            groups[str(node_id)].append(str(sid))
        nodes = {n.id: n for n in (await db.execute(select(NodeRow).where(NodeRow.id.in_(groups)))).scalars()
                 } if groups else {}
    return {nid: (nodes[nid], sids) for nid, sids in groups.items() if nid in nodes}


async def list_approvals(plane: ControlPlane, tenant: str, session_id: str | None = None,
                         include_decided: bool = False) -> ApprovalList:
    """The tenant's pending approvals (oldest first), optionally of one session. A node that cannot be
    reached is left out (logged): its held requests time out as their rules say."""
    items: list[ApprovalOut] = []
    for node, sids in (await _placed(plane, tenant, session_id, running=True)).values():
        page = await attempt(plane.node_client(node).list_approvals(sids, include_decided=include_decided))
        if isinstance(page, NodeError):
            log.warning("could not list approvals on node %s: %s", node.id, page)
            continue
        mine = set(sids)
        items += [_approval_out(a, a.session_id) for a in page.items if a.session_id in mine]
    items.sort(key=lambda a: (a.created_at, a.id))
    return ApprovalList(items=items)


async def _find(plane: ControlPlane, tenant: str, approval_id: str) -> tuple[NodeRow, ApprovalInfo, str]:
    if not is_id(approval_id, "apr"):
        raise ApprovalNotFound(f"approval {approval_id} not found")
    for node, sids in (await _placed(plane, tenant, None, running=False)).values():
        info = await attempt(plane.node_client(node).get_approval(approval_id))
        if isinstance(info, NodeError):
            if info.code != "approval_not_found":
                log.warning("could not look up approval %s on node %s: %s", approval_id, node.id, info)
            continue
        if info.session_id is not None and info.session_id in sids:
            return node, info, info.session_id
    raise ApprovalNotFound(f"approval {approval_id} not found")


async def get_approval(plane: ControlPlane, tenant: str, approval_id: str) -> ApprovalOut:
    _node, info, session_id = await _find(plane, tenant, approval_id)
    return _approval_out(info, session_id)


async def decide(plane: ControlPlane, caller: Principal, approval_id: str, *, approve: bool,
                 body: ApprovalDecisionIn | None) -> ApprovalOut:
    """Approve or deny one of the caller's tenant's pending approvals, as the caller's API key."""
    node, info, session_id = await _find(plane, caller.tenant, approval_id)
    if info.state != "pending":
        raise ApprovalDecided(f"approval {approval_id} is already {info.state}")
    decision = ApprovalDecision(approve=approve, decided_by=caller.key_id, session_id=session_id,
                                scope=body.scope if body else None, reason=body.reason if body else None)
    decided = await attempt(plane.node_client(node).decide_approval(approval_id, decision))
    if isinstance(decided, NodeError):
        if decided.code == "approval_decided":
            raise ApprovalDecided(decided.message) from None
        if decided.code == "approval_not_found":
            raise ApprovalNotFound(f"approval {approval_id} not found") from None
        raise decided  # as the node said it (the problem handler answers with its status and code)
    return _approval_out(decided, session_id)

"""Changing a session's egress policy (``PUT``/``PATCH .../policy``): live on its node while it runs, in
the record while it is paused (applied on resume).

Kept apart from :mod:`capsa.control.egress` (policies, secrets, audit), which session creation uses, so that
neither that module nor :mod:`capsa.control.sessions` has to import the other.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from capsa.common.egress_policy import EgressPolicy, PolicyError
from capsa.control.egress import assign_placeholders, merge_patch, resolve_policy
from capsa.control.egress_schemas import PolicyOut
from capsa.control.errors import InvalidState, ValidationFailed
from capsa.control.nodeclient import NodeError
from capsa.control.plane import ControlPlane
from capsa.control.sessions import node_call_failed, running_session
from capsa.control.store.egress_models import SessionPolicyRow
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["update_policy"]


async def update_policy(plane: ControlPlane, tenant: str, session_id: str, policy: dict[str, Any] | None,
                        patch: dict[str, Any] | None = None) -> PolicyOut:
    """Replace (``policy``) or merge-patch (``patch``) a session's policy: live on its node when it runs;
    for a paused session only the record changes, and its next resume (or branch) starts under it."""
    async with plane.db() as db:
        state = await db.scalar(select(SessionRow.state).where(SessionRow.id == session_id,
                                                              SessionRow.tenant == tenant))
    paused = state == "paused"
    row, client = (None, None) if paused else await running_session(plane, tenant, session_id, fresh=True)
    async with plane.db() as db:
        current = await db.get(SessionPolicyRow, session_id, populate_existing=True)
    if current is None:
        raise InvalidState(f"session {session_id} was created without a policy and has no network; give the "
                           "policy when creating the session", code="no_network")
    if patch is not None:
        merged = merge_patch(current.policy, patch)
        try:
            policy = EgressPolicy.from_data(merged).model_dump(mode="json", exclude_none=True)
        except PolicyError as exc:
            raise ValidationFailed(exc.message, [{"field": "body", "message": exc.message}]) from None
    assert policy is not None
    document, values = await resolve_policy(plane, tenant, policy)
    placeholders = assign_placeholders(document, current.placeholders)
    reissued = False
    if row is not None and client is not None:
        assert row.sandbox_id is not None
        try:
            answer = await client.update_policy(row.sandbox_id, document, values, placeholders)
        except NodeError as exc:
            raise await node_call_failed(plane, row, exc) from exc
        reissued = answer.ca_reissued
    now = utcnow()
    async with plane.db() as db:
        now_state = await db.scalar(select(SessionRow.state).where(SessionRow.id == session_id))
        if paused and now_state != "paused":
            # Resumed meanwhile under the old record: the caller retries against the running sandbox.
            raise InvalidState(f"session {session_id} changed state while its policy was updated")
        stored = await db.get(SessionPolicyRow, session_id, populate_existing=True)
        if stored is not None:
            stored.policy = document
            stored.placeholders = placeholders
            stored.updated_at = now
            await db.commit()
    return PolicyOut(session_id=session_id, policy=document, updated_at=now, ca_reissued=reissued)

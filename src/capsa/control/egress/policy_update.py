"""Changing a session's egress policy (``PUT``/``PATCH .../policy``): live on its node while it runs, in
the record while it is paused (applied on resume).

Kept apart from :mod:`capsa.control.egress.service` (policies, secrets, audit), which session creation uses,
so that neither that module nor :mod:`capsa.control.sessions.service` has to import the other.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from capsa.common.egress_policy import EgressPolicy, PolicyError
from capsa.common.errors import CapsaError
from capsa.common.wire.egress import PolicyOut
from capsa.control.egress.grants import check_policy_networks, tenant_networks
from capsa.control.egress.service import assign_placeholders, merge_patch, resolve_policy
from capsa.control.errors import InvalidState, ValidationFailed
from capsa.control.plane import ControlPlane
from capsa.control.sessions import relay
from capsa.control.store.egress_models import SessionPolicyRow
from capsa.control.store.models import SessionRow, utcnow

__all__ = ["refresh_networks", "update_policy"]

log = logging.getLogger(__name__)


async def update_policy(plane: ControlPlane, tenant: str, session_id: str, policy: dict[str, Any] | None,
                        patch: dict[str, Any] | None = None) -> PolicyOut:
    """Replace (``policy``) or merge-patch (``patch``) a session's policy: live on its node when it runs;
    for a paused session only the record changes, and its next resume (or branch) starts under it."""
    async with plane.db() as db:
        state = await db.scalar(select(SessionRow.state).where(SessionRow.id == session_id,
                                                              SessionRow.tenant == tenant))
    paused = state == "paused"
    target = None if paused else await relay.running(plane, tenant, session_id, fresh=True)
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
    await check_policy_networks(plane, tenant, document)
    placeholders = assign_placeholders(document, current.placeholders)
    reissued = False
    if target is not None:
        networks = await tenant_networks(plane, tenant)
        answer = await relay.call(target, lambda node, sandbox: node.update_policy(
            sandbox, document, values, placeholders, networks))
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


async def refresh_networks(plane: ControlPlane, tenant: str) -> list[str]:
    """Send each running session of ``tenant`` that has a policy its tenant's granted networks now (after a
    grant or a revocation), with its current policy; returns the sessions a node did not take it from
    (logged: they keep their old grants until their sandbox ends, and a revoked network stays refused by
    every sandbox started after it)."""
    networks = await tenant_networks(plane, tenant)
    async with plane.db() as db:
        ids = list(await db.scalars(
            select(SessionRow.id).join(SessionPolicyRow, SessionPolicyRow.session_id == SessionRow.id)
            .where(SessionRow.tenant == tenant, SessionRow.state == "running")))
    missed: list[str] = []
    for session_id in ids:
        try:
            target = await relay.running(plane, tenant, session_id, fresh=True)
            async with plane.db() as db:
                current = await db.get(SessionPolicyRow, session_id, populate_existing=True)
            if current is None:
                continue
            document, values = await resolve_policy(plane, tenant, current.policy)
            await target.client.update_policy(target.sandbox_id, document, values, current.placeholders or {},
                                              networks)
        except CapsaError as exc:
            log.warning("egress grants of session %s not refreshed: %s", session_id, exc.code)
            missed.append(session_id)
    return missed

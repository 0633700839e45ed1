"""Requests held at the broker until a person (or a service) approves or denies them.

An :class:`Approval` lives only while its request is held (and a short while after, so a late or second
decision gets a clear answer): it is meaningful only together with the held connection, so the node keeps it
in memory. The :class:`ApprovalBook` is the node's register of them: the broker opens one per held request
and waits on it, the node API lists and decides them, and session-scoped approvals are remembered as grants
until the sandbox goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field

from capsa.common.egress_policy import ApprovalScope, ApprovalState
from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.common.node_api import ApprovalInfo

__all__ = [
    "Approval",
    "ApprovalBook",
    "ApprovalError",
    "Outcome",
    "new_approval_id",
]

_log = logging.getLogger(__name__)

_DECIDED_KEPT = 1000
_DECIDED_FOR_S = 3600.0


class ApprovalError(CapsaError):
    code = "approval_not_found"
    status = 404


@dataclass(frozen=True)
class Outcome:
    approved: bool
    state: ApprovalState
    scope: ApprovalScope
    decided_by: str | None
    reason: str | None


class Approval(ApprovalInfo):
    """A held request: what the node API shows of it (:class:`ApprovalInfo`; its ``preview`` is the first
    :data:`~capsa.node.egress.approval_hold.PREVIEW_BYTES` of the body, redacted) and the futures that tie it
    to the held connection."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    state: ApprovalState = "pending"
    future: asyncio.Future[Outcome] | None = Field(default=None, exclude=True, repr=False)
    """Resolved with the decision (made by :meth:`ApprovalBook.open`)."""
    waiter: asyncio.Future[Any] | None = Field(default=None, exclude=True, repr=False)
    """The connection task holding the request (so a stopping sandbox can let it answer before its
    listeners close)."""

    def as_dict(self) -> dict[str, Any]:
        """What the node API and the approval webhook show (no futures)."""
        return self.model_dump()


Notify = Callable[[Approval], None]


class ApprovalBook:
    """Pending approvals of a node's sandboxes, recent decisions, and session-scoped grants."""

    def __init__(self) -> None:
        self._pending: dict[str, Approval] = {}
        self._decided: OrderedDict[str, Approval] = OrderedDict()
        self._grants: dict[str, set[str]] = {}  # sandbox id -> approval rule keys approved for the session
        self.on_change: Notify | None = None
        """Called on every transition (opened, then decided, timed out or cancelled): the audit hook."""

    # -- the broker's side ---------------------------------------------------------------------------

    def granted(self, sandbox_id: str, key: str) -> bool:
        return key in self._grants.get(sandbox_id, set())

    def pending_of(self, sandbox_id: str) -> int:
        return sum(1 for a in self._pending.values() if a.sandbox_id == sandbox_id)

    def open(self, approval: Approval) -> Approval:
        """Register a new pending approval (its ``future`` is made here)."""
        approval.future = asyncio.get_running_loop().create_future()
        self._pending[approval.id] = approval
        self._changed(approval)
        return approval

    async def wait(self, approval: Approval, grant_key: str) -> Outcome:
        """The decision, or a timeout at ``expires_at``; a ``session`` approval becomes a grant."""
        assert approval.future is not None
        try:
            outcome = await asyncio.wait_for(asyncio.shield(approval.future),
                                             max(0.0, approval.expires_at - time.time()))
        except TimeoutError:
            outcome = self._close(approval, "timeout", None, None, approval.scope)
        except asyncio.CancelledError:
            # The connection went away (client closed, sandbox stopped): nobody is waiting any more.
            if approval.state == "pending":
                self._close(approval, "cancelled", None, "the held request was abandoned", approval.scope)
            raise
        if outcome.approved and outcome.scope == "session":
            self._grants.setdefault(approval.sandbox_id, set()).add(grant_key)
        return outcome

    def cancel_sandbox(self, sandbox_id: str, reason: str) -> list[Approval]:
        """Deny every pending approval of the sandbox (it is being destroyed or paused) and forget its
        grants; returns the approvals so closed."""
        closed = [a for a in list(self._pending.values()) if a.sandbox_id == sandbox_id]
        for approval in closed:
            self._close(approval, "cancelled", None, reason, approval.scope)
        self._grants.pop(sandbox_id, None)
        return closed

    def clear_grants(self, sandbox_id: str) -> None:
        """Forget the sandbox's session-scoped approvals (its policy changed: they were for the old rules)."""
        self._grants.pop(sandbox_id, None)

    # -- the API's side ------------------------------------------------------------------------------

    def list(self, session_ids: Iterable[str] | None = None, *, include_decided: bool = False
             ) -> list[Approval]:
        wanted = set(session_ids) if session_ids is not None else None
        self._expire_decided()
        items = list(self._pending.values()) + (list(self._decided.values()) if include_decided else [])
        return sorted((a for a in items if wanted is None or a.session_id in wanted),
                      key=lambda a: (a.created_at, a.id))

    def get(self, approval_id: str) -> Approval:
        self._expire_decided()
        found = self._pending.get(approval_id) or self._decided.get(approval_id)
        if found is None:
            raise ApprovalError(f"approval {approval_id} not found")
        return found

    def decide(self, approval_id: str, *, approve: bool, decided_by: str, scope: ApprovalScope | None = None,
               reason: str | None = None, session_id: str | None = None) -> Approval:
        """Approve or deny a pending approval. ``session_id``, when given, must be the approval's (the
        caller's proof that it may decide it); a decided one raises ``approval_decided`` (409)."""
        approval = self.get(approval_id)
        if session_id is not None and approval.session_id != session_id:
            raise ApprovalError(f"approval {approval_id} not found")
        if approval.state != "pending":
            raise ApprovalError(f"approval {approval_id} is already {approval.state}",
                                code="approval_decided", status=409)
        self._close(approval, "approved" if approve else "denied", decided_by, reason,
                    scope or approval.scope)
        return approval

    # -- internals -----------------------------------------------------------------------------------

    def _close(self, approval: Approval, state: ApprovalState, decided_by: str | None, reason: str | None,
               scope: ApprovalScope) -> Outcome:
        approval.state, approval.decided_by, approval.reason = state, decided_by, reason
        approval.decided_at = time.time()
        approval.scope = scope
        outcome = Outcome(state == "approved", state, scope, decided_by, reason)
        self._pending.pop(approval.id, None)
        self._decided[approval.id] = approval
        while len(self._decided) > _DECIDED_KEPT:
            self._decided.popitem(last=False)
        if approval.future is not None and not approval.future.done():
            approval.future.set_result(outcome)
        self._changed(approval)
        return outcome

    def _changed(self, approval: Approval) -> None:
        if self.on_change is not None:
            try:
                self.on_change(approval)
            except Exception:
                _log.exception("approval hook failed for %s", approval.id)

    def _expire_decided(self) -> None:
        cutoff = time.time() - _DECIDED_FOR_S
        while self._decided:
            first = next(iter(self._decided.values()))
            if (first.decided_at or 0.0) >= cutoff:
                break
            self._decided.popitem(last=False)


def new_approval_id() -> str:
    return new_id("apr")

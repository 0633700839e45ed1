"""Holding a request an approval rule matches until its approval is decided (docs/approvals.md).

The request is read whole first (within the request limit, charged to the buffer budget; see the request
loop), opened as an :class:`Approval` in the node's :class:`ApprovalBook` (approvals.py) with a redacted
preview of its body, announced to the policy's ``approval_webhook``, and kept unforwarded until it is
approved, denied, timed out, its client goes away or its sandbox stops. Every transition is audited
(:func:`approval_event`).
"""

from __future__ import annotations

import asyncio
import time

from capsa.common.egress_policy import ApprovalRule, DomainRule
from capsa.node.egress.approvals import Approval, ApprovalBook, new_approval_id
from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.http1 import STREAM_LIMIT, Client, Deny, Request
from capsa.node.egress.injection import Credentials
from capsa.node.egress.redaction import SecretLeak, SecretPatterns
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.webhooks import Notifier

__all__ = ["PENDING_PER_SANDBOX", "PREVIEW_BYTES", "ApprovalHolds", "approval_event", "grant_key"]

PREVIEW_BYTES = 2048
"""How much of a held request's body an approval shows (after redaction)."""
PENDING_PER_SANDBOX = 16
"""Held requests one sandbox may have at once; more are refused (429) rather than queued."""

_APPROVAL_ACTIONS = {"pending": "requested", "approved": "approved", "denied": "denied",
                     "timeout": "timed_out", "cancelled": "cancelled"}
"""The ``action`` of an approval event (its ``detail``), by the approval's state."""


def grant_key(rule: DomainRule, approval: ApprovalRule) -> str:
    """What a ``session`` approval covers: this approval rule of this domain rule."""
    return f"{rule.domain}/{approval.name}"


def approval_event(approval: Approval) -> EgressEvent:
    """The ``approval`` event of one transition: opened (pending), approved, denied, timed out, cancelled."""
    state = approval.state
    if state == "pending":
        reason = f"approval {approval.id} pending (rule {approval.approval_rule})"
    elif state == "timeout":
        reason = f"approval {approval.id} timed out"
    elif state == "cancelled":
        reason = f"approval {approval.id} cancelled: {approval.reason or ''}".rstrip(": ")
    else:
        reason = f"approval {approval.id} {state} by {approval.decided_by} (scope {approval.scope})"
        if approval.reason:
            reason += f": {approval.reason[:200]}"
    return EgressEvent(
        kind="approval", session_id=approval.session_id, sandbox_id=approval.sandbox_id,
        destination=approval.destination, method=approval.method, path=approval.path,
        decision="allow" if state == "approved" else "deny", rule=approval.rule, reason=reason,
        bytes_out=approval.body_bytes,
        detail={"action": _APPROVAL_ACTIONS[state], "approval_id": approval.id, "decision": state,
                "decided_by": approval.decided_by,
                "scope": approval.scope, "approval_rule": approval.approval_rule,
                "reason": approval.reason, "expires_at": approval.expires_at})


def preview(sbx: SandboxEgress, patterns: SecretPatterns, body: bytes) -> str:
    """The start of a held body as an approver sees it: placeholders and secrets redacted."""
    head = body[:PREVIEW_BYTES + patterns.window]
    for ph in sbx.placeholders:
        head = head.replace(ph.encode(), b"[PLACEHOLDER]")
    try:
        head = patterns.redact(head)
        patterns.check_leak(head)
    except SecretLeak:
        return "[preview withheld: the body holds part of a secret]"
    return head[:PREVIEW_BYTES].decode("utf-8", "replace")


class ApprovalHolds:
    """Holds requests in ``book`` and sends the policies' approval webhooks with ``notifier``; previews are
    redacted with the forms of the ``credentials``' secrets."""

    def __init__(self, book: ApprovalBook, notifier: Notifier, credentials: Credentials) -> None:
        self.book, self.notifier, self.credentials = book, notifier, credentials

    def covered(self, sandbox_id: str, rule: DomainRule, match: ApprovalRule) -> bool:
        """Whether a session approval already granted this approval rule of ``rule``."""
        return self.book.granted(sandbox_id, grant_key(rule, match))

    async def hold(self, sbx: SandboxEgress, client: Client, req: Request, rule: DomainRule,
                   match: ApprovalRule, body: bytes) -> None:
        """Hold the request until its approval is decided; returns when approved, else raises a 403."""
        assert match.name is not None
        for ph, binding in sbx.placeholders.items():
            if ph.encode() in body:
                raise Deny(403, f"placeholder of {binding.secret} in the request body", rule=rule.domain)
        if self.book.pending_of(sbx.sandbox_id) >= PENDING_PER_SANDBOX:
            raise Deny(429, f"more than {PENDING_PER_SANDBOX} requests of this sandbox await approval",
                       rule=rule.domain)
        now = time.time()
        approval = self.book.open(Approval(
            id=new_approval_id(), sandbox_id=sbx.sandbox_id, session_id=sbx.session_id,
            destination=req.host, method=req.method, path=sbx.scrub(req.path), rule=rule.domain,
            approval_rule=match.name, scope=match.scope,
            preview=preview(sbx, self.credentials.patterns(sbx), body),
            body_bytes=len(body), created_at=now, expires_at=now + match.timeout_s))
        if sbx.policy.approval_webhook:
            self.notifier.notify(sbx.policy.approval_webhook, approval.as_dict())
        approval.waiter = asyncio.current_task()
        waiter = asyncio.ensure_future(self.book.wait(approval, grant_key(rule, match)))
        watcher = asyncio.ensure_future(_watch_client(client))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not waiter.done():
                waiter.cancel()  # the connection went away: the approval is cancelled as abandoned
            await asyncio.gather(watcher, waiter, return_exceptions=True)
        if waiter.cancelled() or waiter.exception() is not None:
            raise Deny(403, f"approval {approval.id} abandoned: the client went away", rule=rule.domain)
        outcome = waiter.result()
        if outcome.approved:
            req.approval_id = approval.id
            return
        messages = {"denied": "approval denied", "timeout": f"approval timed out after {match.timeout_s} s",
                    "cancelled": "approval cancelled"}
        message = messages.get(outcome.state, "approval refused")
        if outcome.state == "denied" and outcome.decided_by:
            message += f" by {outcome.decided_by}"
        raise Deny(403, f"{message} (approval {approval.id})"
                   + (f": {outcome.reason[:200]}" if outcome.reason else ""), rule=rule.domain,
                   body={"error": f"approval_{outcome.state}", "approval_id": approval.id,
                         "message": message, "reason": outcome.reason, "decided_by": outcome.decided_by},
                   detail={"approval_id": approval.id, "decision": outcome.state,
                           "decided_by": outcome.decided_by})


async def _watch_client(client: Client) -> None:
    """Returns when the held request's client closes its connection. Bytes it pipelines meanwhile are
    kept for h11 (bounded: a client that sends more while waiting is treated as gone)."""
    extra = 0
    while True:
        data = await client.reader.read(STREAM_LIMIT)
        if not data:
            return
        extra += len(data)
        if extra > STREAM_LIMIT:
            return
        client.conn.receive_data(data)

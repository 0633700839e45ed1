"""Adding connections' access tokens to a request's head: the part of the broker that decides, for one
request to a destination, which tokens go in which header, and audits each use (never the token).

The broker calls :func:`inject_tokens` after the placeholder swap; a refusal comes back as
:class:`TokenRefused` (status, reason), which the broker answers and audits like its other refusals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from capsa.node.egress.policy import EgressPolicy
from capsa.node.egress.tokens import ConnectionRevoked, ConnectionTokens, TokenUnavailable

__all__ = ["TokenRefused", "TokenRequest", "inject_tokens"]

Audit = Callable[..., None]
"""Writes one audit event of the sandbox (the broker's ``_audit`` bound to it): keyword fields."""


class TokenRefused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass
class TokenRequest:
    """What injection needs to know of one request; ``headers`` is replaced in place."""

    host: str
    method: str
    path: str
    """As audited (scrubbed, bounded)."""
    headers: list[tuple[bytes, bytes]]
    tls: bool
    source: str
    rule: str | None


async def inject_tokens(tokens: ConnectionTokens, policy: EgressPolicy, session_id: str | None,
                        req: TokenRequest, audit: Audit) -> list[str]:
    """Set the header of every connection bound to ``req.host`` (replacing one the sandbox sent) to the
    connection's current token, over verified HTTPS only; returns the connection ids used."""
    used: list[str] = []
    for binding in policy.connections_for(req.host):
        cid = binding.connection
        base = {"kind": "connection", "source": req.source, "destination": req.host, "method": req.method,
                "path": req.path, "rule": req.rule}
        if not req.tls:
            audit(decision="deny", reason=f"connection {cid}: token only sent over HTTPS", status=403,
                  detail={"connection_id": cid, "action": "inject"}, **base)
            raise TokenRefused(403, f"connection {cid} is bound to {req.host} over HTTPS only")
        if session_id is None:
            raise TokenRefused(403, f"connection {cid} needs a session")
        try:
            issued = await tokens.current(cid, session_id)
        except ConnectionRevoked:
            audit(decision="deny", reason=f"connection {cid}: revoked", status=403,
                  detail={"connection_id": cid, "action": "revoked"}, **base)
            raise TokenRefused(403, f"connection {cid} was revoked") from None
        except TokenUnavailable as exc:
            audit(decision="error", reason=f"connection {cid}: {exc.code}", status=503,
                  detail={"connection_id": cid, "action": "refresh"}, **base)
            raise TokenRefused(503, f"no access token for connection {cid} now ({exc.code})") from None
        if issued.fetched:
            audit(decision="allow", reason=f"connection {cid}: token fetched",
                  detail={"connection_id": cid, "action": "refresh"}, **base)
        name = binding.header.lower().encode()
        req.headers = [(k, v) for k, v in req.headers if k != name]
        req.headers.append((name, binding.header_value(issued.value).encode()))
        used.append(cid)
        audit(decision="allow", reason=f"connection {cid}: token injected",
              detail={"connection_id": cid, "action": "inject"}, **base)
    return used

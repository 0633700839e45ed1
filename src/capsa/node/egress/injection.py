"""What the broker puts into a request, and the secret values it must keep out of everything else.

* Secrets: a sandbox holds placeholders, never values. A placeholder in the header its binding names, sent
  over verified HTTPS to the binding's exact destination, is swapped for the secret; any other use of one (the
  URL, another header, another host, plain HTTP, the body) is refused.
* Connections: the header of every connection a policy binds to the destination is set to the connection's
  current access token (over HTTPS only); each use is audited, never the token.
* Redaction: the forms of every value a sandbox's bindings reveal (:meth:`Credentials.patterns`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from urllib.parse import unquote

from capsa.common.egress_policy import SecretBinding
from capsa.common.errors import CapsaError
from capsa.node.egress.http1 import Deny, Request
from capsa.node.egress.redaction import SecretPatterns
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.secrets import SecretStore
from capsa.node.egress.tokens import ConnectionRevoked, ConnectionTokens, TokenUnavailable

__all__ = ["Credentials", "PlaceholderScan"]


class Credentials:
    """The secret store and the connections' tokens, as the broker's requests use them."""

    def __init__(self, secrets: SecretStore, tokens: ConnectionTokens) -> None:
        self.secrets, self.tokens = secrets, tokens

    def swap_placeholders(self, sbx: SandboxEgress, req: Request, tls: bool) -> None:
        """Swap placeholders for secrets in the request head where a binding allows it; refuse any other
        use of one. (The body is checked for placeholders as it streams, see :class:`PlaceholderScan`.)"""
        if not sbx.placeholders:
            return
        for ph, binding in sbx.placeholders.items():
            needle = ph.encode()
            if needle in req.target.encode("latin-1") or needle in unquote(req.target).encode("latin-1"):
                raise Deny(403, f"placeholder of {binding.secret} in the URL")
            new_headers: list[tuple[bytes, bytes]] = []
            for name, value in req.headers:
                if needle not in value and needle not in name:
                    new_headers.append((name, value))
                    continue
                if name != binding.header.lower().encode() or needle in name:
                    raise Deny(403, f"placeholder of {binding.secret} in header {name.decode('latin-1')}")
                if req.host != binding.domain:
                    raise Deny(403, f"placeholder of {binding.secret} sent to {req.host}, "
                                    f"it is bound to {binding.domain}")
                if not tls:
                    raise Deny(403, f"placeholder of {binding.secret} over plain HTTP")
                secret = self.secrets.reveal(binding.secret).encode()
                new_headers.append((name, value.replace(needle, secret)))
                req.secret_ids.append(binding.secret)
            req.headers = new_headers

    async def inject_tokens(self, sbx: SandboxEgress, req: Request, tls: bool, source: str) -> None:
        """Set the header of every connection bound to ``req.host`` (replacing one the sandbox sent) to the
        connection's current token, over verified HTTPS only (each use audited)."""
        rule = req.rule.domain if req.rule else None
        for binding in sbx.policy.connections_for(req.host):
            cid = binding.connection
            base = {"kind": "connection", "source": source, "destination": req.host, "method": req.method,
                    "path": sbx.scrub(req.path), "rule": rule}
            if not tls:
                sbx.audit(decision="deny", reason=f"connection {cid}: token only sent over HTTPS", status=403,
                          detail={"connection_id": cid, "action": "inject"}, **base)
                raise Deny(403, f"connection {cid} is bound to {req.host} over HTTPS only", rule=rule)
            if sbx.session_id is None:
                raise Deny(403, f"connection {cid} needs a session", rule=rule)
            try:
                issued = await self.tokens.current(cid, sbx.session_id)
            except ConnectionRevoked:
                sbx.audit(decision="deny", reason=f"connection {cid}: revoked", status=403,
                          detail={"connection_id": cid, "action": "revoked"}, **base)
                raise Deny(403, f"connection {cid} was revoked", rule=rule) from None
            except TokenUnavailable as exc:
                sbx.audit(decision="error", reason=f"connection {cid}: {exc.code}", status=503,
                          detail={"connection_id": cid, "action": "refresh"}, **base)
                raise Deny(503, f"no access token for connection {cid} now ({exc.code})", rule=rule) from None
            if issued.fetched:
                sbx.audit(decision="allow", reason=f"connection {cid}: token fetched",
                          detail={"connection_id": cid, "action": "refresh"}, **base)
            name = binding.header.lower().encode()
            req.headers = [(k, v) for k, v in req.headers if k != name]
            req.headers.append((name, binding.header_value(issued.value).encode()))
            sbx.audit(decision="allow", reason=f"connection {cid}: token injected",
                      detail={"connection_id": cid, "action": "inject"}, **base)

    def patterns(self, sbx: SandboxEgress) -> SecretPatterns:
        """The redaction forms of every secret and token the sandbox's policy binds."""
        def values() -> list[bytes]:
            out: list[bytes] = []
            for binding in sbx.placeholders.values():
                with contextlib.suppress(CapsaError):
                    out.append(self.secrets.reveal(binding.secret).encode())
            for conn in sbx.policy.connections:
                token = self.tokens.peek(conn.connection)
                if token:
                    out.append(token.encode())
            return out

        return sbx.patterns.get(self.tokens.generation() if sbx.policy.connections else -1, values)


class PlaceholderScan:
    """Refuses a request body that holds a placeholder, also across the chunks it streams in."""

    def __init__(self, placeholders: Mapping[str, SecretBinding]) -> None:
        self._needles = [(ph.encode(), b.secret) for ph, b in placeholders.items()]
        self._carry_len = max((len(n) for n, _ in self._needles), default=1) - 1
        self._carry = b""

    def check(self, data: bytes) -> None:
        window = self._carry + data
        for needle, secret_id in self._needles:
            if needle in window:
                raise Deny(403, f"placeholder of {secret_id} in the request body")
        self._carry = window[-self._carry_len:] if self._carry_len else b""

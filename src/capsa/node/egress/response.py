"""A destination's response on its way back to the sandbox: the checks of its head (download content types,
declared size), redaction of a bound destination's headers and body (redaction.py), and the body streamed at
the minimum rate. A bound destination's small body (declared length up to ``SMALL_BODY``) is read whole,
redacted, and sent with its new exact length, as clients of most APIs expect.
"""

from __future__ import annotations

import time

import h11

from capsa.common.egress_policy import DomainRule
from capsa.node.egress.http1 import HOP_BY_HOP, Client, Deny, Request, header, printable, until
from capsa.node.egress.limits import BrokerLimits, ByteBudget, Pace
from capsa.node.egress.redaction import SecretLeak, SecretPatterns, StreamRedactor
from capsa.node.egress.upstream import Upstream

__all__ = ["SMALL_BODY", "relay_response"]

SMALL_BODY = 256 * 1024
"""A bound destination's response up to this declared length is redacted whole and keeps a length."""

Headers = list[tuple[bytes, bytes]]


async def relay_response(client: Client, up: Upstream, req: Request, rule: DomainRule, limit: int,
                         patterns: SecretPatterns | None, budget: ByteBudget, limits: BrokerLimits
                         ) -> tuple[int, int]:
    """Read the response to ``req`` from ``up`` and send it to ``client`` (redacted with ``patterns`` when
    the destination is bound); (status, body bytes). ``limit``: the most its body may hold."""
    domain = rule.domain
    response = await up.next_event(until(time.monotonic() + limits.upstream_timeout))
    while isinstance(response, h11.InformationalResponse):
        response = await up.next_event(until(time.monotonic() + limits.upstream_timeout))
    if not isinstance(response, h11.Response):
        raise Deny(502, "upstream closed without a response", rule=domain)
    no_body = req.method == "HEAD" or response.status_code in (204, 304)
    if not no_body and rule.download_content_types is not None:
        types = header(response.headers, b"content-type")
        value = types[0].decode("latin-1") if len(types) == 1 else None
        if not rule.allows_download(value):
            shown = printable(types[0]) if len(types) == 1 else ("none" if not types else "several")
            raise Deny(403, f"download of content type {shown} is not allowed for {domain}", rule=domain)
    lengths = header(response.headers, b"content-length")
    if len(lengths) == 1 and int(lengths[0]) > limit and not no_body:
        raise Deny(502, f"response body over {limit} bytes", rule=domain)
    headers = [(k, v) for k, v in response.headers if k not in HOP_BY_HOP]
    redactor: StreamRedactor | None = None
    if patterns:
        encoded = any(k == b"content-encoding" and v.strip().lower() != b"identity" for k, v in headers)
        if encoded and not no_body:
            raise Deny(502, "encoded response from a destination a secret is bound to cannot be checked",
                       rule=domain)
        try:
            headers = [(k, patterns.redact(v)) for k, v in headers]
            for _k, v in headers:
                patterns.check_leak(v)
        except SecretLeak:
            raise Deny(502, "response header holds part of a secret", rule=domain) from None
        redactor = StreamRedactor(patterns)
        if no_body and len(lengths) == 1:
            headers.append((b"content-length", lengths[0]))
        elif len(lengths) == 1 and int(lengths[0]) <= SMALL_BODY:
            return await _small_redacted(client, up, response, headers, patterns, int(lengths[0]), domain,
                                         budget, limits)
        # Otherwise no length: redaction may change it, h11 frames the body as chunked.
    elif len(lengths) == 1:
        headers.append((b"content-length", lengths[0]))
    pace = Pace(limits.min_rate, limits.rate_grace)
    await client.send(h11.Response(status_code=response.status_code, headers=headers,
                                   reason=response.reason), left=pace.remaining)
    size = 0
    pending: h11.Event | None = None
    while True:
        ev = pending if pending is not None else await up.next_event(pace.remaining)
        pending = None
        if isinstance(ev, h11.Data):
            size += len(ev.data)
            pace.add(len(ev.data))
            if size > limit:
                raise Deny(502, f"response body over {limit} bytes (cut off)", rule=domain)
            nxt = up.conn.next_event()
            if nxt is not h11.NEED_DATA:
                pending = nxt  # type: ignore[assignment]
            try:
                out = redactor.feed(bytes(ev.data)) if redactor else bytes(ev.data)
                if redactor and isinstance(pending, h11.EndOfMessage):
                    out += redactor.finish()  # all of it in one piece: nothing held back between chunks
                    redactor = None
            except SecretLeak:
                raise Deny(502, "response holds part of a secret (cut off)", rule=domain) from None
            if out:
                await client.send(h11.Data(data=out), left=pace.remaining)
        elif isinstance(ev, h11.EndOfMessage):
            if redactor is not None:
                try:
                    out = redactor.finish()
                except SecretLeak:
                    raise Deny(502, "response holds part of a secret (cut off)", rule=domain) from None
                if out:
                    await client.send(h11.Data(data=out), left=pace.remaining)
            break
        else:
            raise Deny(502, "upstream response ended early", rule=domain)
    await client.send(h11.EndOfMessage(), left=pace.remaining)
    up.finish()
    return response.status_code, size


async def _small_redacted(client: Client, up: Upstream, response: h11.Response, headers: Headers,
                          patterns: SecretPatterns, length: int, domain: str, budget: ByteBudget,
                          limits: BrokerLimits) -> tuple[int, int]:
    """A small bound-host body read whole (its bytes charged to the budget), redacted, and sent with its
    new exact length."""
    try:
        await budget.reserve(length, limits.head_timeout)
    except TimeoutError:
        raise Deny(503, "egress buffer budget exhausted", rule=domain) from None
    try:
        pace = Pace(limits.min_rate, limits.rate_grace)
        body = bytearray()
        while True:
            ev = await up.next_event(pace.remaining)
            if isinstance(ev, h11.Data):
                body += ev.data
                pace.add(len(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise Deny(502, "upstream response ended early", rule=domain)
        out = patterns.redact(bytes(body))
        try:
            patterns.check_leak(out)
        except SecretLeak:
            raise Deny(502, "response holds part of a secret", rule=domain) from None
        events: list[h11.Event] = [h11.Response(
            status_code=response.status_code, reason=response.reason,
            headers=[*headers, (b"content-length", str(len(out)).encode())])]
        if out:
            events.append(h11.Data(data=out))
        await client.send(*events, h11.EndOfMessage(), left=pace.remaining)
    finally:
        budget.release(length)
    up.finish()
    return response.status_code, len(body)

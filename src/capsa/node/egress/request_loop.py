"""One sandbox connection's requests, in order: the h11 loop, CONNECT (TLS inside the tunnel), and for each
request the checks (request_head.py, the policy's rule), injection (injection.py), an approval hold where a
rule asks for one (approval_hold.py), the upstream (upstream.py), the body and the response (response.py),
and one audit event.

A request body goes through one loop (:meth:`RequestLoop._pump_body`) whether it streams upstream or is
read whole first (a request an approval rule may hold): the rate, size and upload checks are made there.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable

import h11

from capsa.common.addresses import is_ip_literal
from capsa.common.egress_policy import DomainRule
from capsa.node.egress.approval_hold import ApprovalHolds
from capsa.node.egress.http1 import (
    HOP_BY_HOP,
    Client,
    Deny,
    Request,
    header,
    send_deny,
    send_plain_error,
    until,
)
from capsa.node.egress.injection import Credentials, PlaceholderScan
from capsa.node.egress.limits import BrokerLimits, Pace, TokenBucket
from capsa.node.egress.request_head import (
    Mode,
    body_length,
    check_framing,
    check_upload,
    destination,
    split_host,
)
from capsa.node.egress.response import relay_response
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.tls import TlsFront, tls_leaf
from capsa.node.egress.upstream import Upstream, Upstreams

__all__ = ["RequestLoop"]


class RequestLoop:
    """Serves the connections of every sandbox with the node's ``limits``, ``upstreams``, ``credentials``,
    approval ``holds`` and ``tls`` front."""

    def __init__(self, limits: BrokerLimits, upstreams: Upstreams, credentials: Credentials,
                 holds: ApprovalHolds, tls: TlsFront) -> None:
        self.limits, self.upstreams, self.credentials = limits, upstreams, credentials
        self.holds, self.tls = holds, tls

    async def serve(self, sbx: SandboxEgress, mode: Mode, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, *, tls_host: str | None = None) -> None:
        """Serve one connection until it closes, fails a check that ends it, or idles out."""
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        if source != sbx.guest_ip:
            sbx.audit(kind="http", decision="deny", source=source,
                      reason="connection from an address that is not the sandbox's")
            return
        client = Client(reader, writer)
        pinned: str | None = tls_host  # the one host this connection may talk to
        tls = tls_host is not None
        upstream: Upstream | None = None
        first = True
        try:
            while True:
                # The whole request head within its deadline, however slowly its bytes come.
                wait = self.limits.head_timeout if first else self.limits.idle_timeout
                first = False
                try:
                    event = await client.next_event(until(time.monotonic() + wait))
                except h11.RemoteProtocolError as exc:
                    sbx.audit(kind="http", decision="deny", source=source, destination=pinned,
                              status=400, reason=f"malformed HTTP: {str(exc)[:200]}")
                    await send_plain_error(writer, 400, "malformed request", self.limits.head_timeout)
                    return
                if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return
                if not isinstance(event, h11.Request):
                    return
                if mode == "proxy" and event.method == b"CONNECT" and not tls:
                    host = await self._connect(sbx, client, event, source)
                    if host is None:
                        return
                    sni = await self.tls.start_tls(sbx, client, host)
                    if sni != host:
                        if sni is not None:
                            sbx.audit(kind="tls", decision="deny", source=source, destination=sni,
                                      reason=f"TLS server name does not match the CONNECT target {host}")
                        return
                    pinned, tls = host, True
                    client = Client(reader, writer)
                    first = True
                    continue
                keep, pinned, upstream = await self._one_request(sbx, mode, client, event, source, pinned,
                                                                 tls, upstream)
                if not keep:
                    return
                if client.conn.our_state is h11.DONE and client.conn.their_state is h11.DONE:
                    client.conn.start_next_cycle()
                else:
                    return
        finally:
            if upstream is not None:
                upstream.close()

    def _head_left(self) -> Callable[[], float]:
        return until(time.monotonic() + self.limits.head_timeout)

    async def _connect(self, sbx: SandboxEgress, client: Client, req: h11.Request, source: str) -> str | None:
        """Answer a CONNECT: the host of the tunnel, or None when it was refused."""
        target = req.target.decode("latin-1")
        # Read nothing more until TLS takes over the transport: bytes the transport read now would land in
        # the StreamReader's buffer, which start_tls never hands to TLS, and the handshake would hang (a
        # ClientHello sent as soon as the 200 arrives could be read while we still await the drain or the
        # leaf). Paused, they wait in the socket; the loop's start_tls resumes reading under TLS.
        transport = client.writer.transport
        if isinstance(transport, asyncio.ReadTransport):  # typed as a WriteTransport; a socket's is both
            transport.pause_reading()
        try:
            host, port = split_host(target, -1)
            if port != 443:
                raise Deny(403, "CONNECT is only allowed to port 443")
            if is_ip_literal(host):
                raise Deny(403, "IP-literal destinations are refused")
            rule = sbx.policy.rule_for(host)
            if rule is None:
                raise Deny(403, "destination not allowed by policy")
            if header(req.headers, b"upgrade"):
                raise Deny(403, "protocol upgrade refused")
        except Deny as deny:
            sbx.audit(kind="connect", decision="deny", source=source, destination=target[:255],
                      method="CONNECT", status=deny.status, reason=deny.reason)
            await client.send(h11.Response(status_code=deny.status,
                                           headers=[(b"content-length", b"0"), (b"connection", b"close")]),
                              left=self._head_left())
            return None
        leaf = tls_leaf(sbx, host)
        if leaf is not None:
            await sbx.ca.context_for(leaf)  # before the 200: the client's ClientHello follows it at once
        await client.send(h11.Response(status_code=200, headers=[]), left=self._head_left())
        if client.conn.trailing_data[0]:
            return None  # TLS bytes pipelined before our answer: refuse rather than guess
        sbx.audit(kind="connect", decision="allow", source=source, destination=f"{host}:{port}",
                  method="CONNECT", status=200, rule=rule.domain)
        return host

    async def _one_request(self, sbx: SandboxEgress, mode: Mode, client: Client, ev: h11.Request,
                           source: str, pinned: str | None, tls: bool, upstream: Upstream | None
                           ) -> tuple[bool, str | None, Upstream | None]:
        """Check, forward and audit one request; (keep the connection, its pinned host, its upstream)."""
        method = ev.method.decode("latin-1").upper()
        target = ev.target.decode("latin-1")
        req = Request(method, target, target, pinned or "", 0, list(ev.headers))
        resolved: str | None = None
        body: bytes | None = None
        reserved = 0
        assert sbx.budget is not None
        try:
            check_framing(req)
            default_port = self.upstreams.https_port if tls else self.upstreams.http_port
            destination(req, mode, tls, pinned, default_port, self.upstreams.http_port)
            pinned = req.host
            rule = self._rule(sbx, req)
            limit = sbx.policy.request_limit(rule)
            length = body_length(req, rule, limit)
            check_upload(rule, length)
            self.credentials.swap_placeholders(sbx, req, tls)
            plain_path = req.path.split("?", 1)[0]
            holds = [a for a in rule.approvals or () if a.matches(method, plain_path, length)]
            # With a declared length the first match is certain: a session approval of it needs no body.
            covered = not holds or (length is not None and self.holds.covered(sbx.sandbox_id, rule, holds[0]))
            if not covered:
                # The body decides (min_body_bytes) and is shown: it is read whole (within the request
                # limit, charged to the buffer budget) and forwarded only once the request may go.
                body, reserved = await self._read_body(sbx, client, req, rule, limit)
                length = len(body)
                match = next((a for a in holds if a.matches(method, plain_path, length)), None)
                if match is not None and not self.holds.covered(sbx.sandbox_id, rule, match):
                    await self.holds.hold(sbx, client, req, rule, match, body)
            await self.credentials.inject_tokens(sbx, req, tls, source)
            upstream, resolved = await self.upstreams.for_request(req.host, sbx.granted, tls, upstream)
            status, resp_len = await self._exchange(sbx, client, upstream, req, rule, length, limit, body)
        except Deny as deny:
            if upstream is not None and deny.status != 429:
                upstream.close()  # it may have seen part of a request or response: never reuse it
                upstream = None
            sbx.audit(kind="http", decision="deny", source=source, destination=req.host or pinned,
                      resolved_ip=resolved, method=method, path=sbx.scrub(req.path), status=deny.status,
                      rule=deny.rule, reason=deny.reason, bytes_out=req.bytes_out, detail=deny.detail)
            await send_deny(client, deny, self.limits.head_timeout)
            return (not deny.close and client.conn.their_state is h11.DONE), pinned, upstream
        finally:
            if reserved:
                sbx.budget.release(reserved)
        sbx.audit(kind="http", decision="allow", source=source, destination=req.host,
                  resolved_ip=resolved, method=method, path=sbx.scrub(req.path), status=status,
                  rule=req.rule.domain if req.rule else None, bytes_out=req.bytes_out, bytes_in=resp_len,
                  secret_ids=req.secret_ids,
                  detail={"approval_id": req.approval_id} if req.approval_id else None)
        return True, pinned, upstream

    @staticmethod
    def _rule(sbx: SandboxEgress, req: Request) -> DomainRule:
        """The policy rule that lets the request through (method, path and rate checked)."""
        rule = sbx.policy.rule_for(req.host)
        if rule is None:
            raise Deny(403, "destination not allowed by policy")
        req.rule = rule
        if not rule.allows_method(req.method):
            raise Deny(403, f"method {req.method} not allowed for {rule.domain}", rule=rule.domain)
        if not rule.allows_path(req.path.split("?", 1)[0]):
            raise Deny(403, "path not allowed by policy", rule=rule.domain)
        if rule.rate_limit is not None:
            bucket = sbx.buckets.get(rule.domain)
            if bucket is None:
                bucket = sbx.buckets[rule.domain] = TokenBucket(rule.rate_limit.requests_per_minute,
                                                                rule.rate_limit.burst)
            if not bucket.take():
                raise Deny(429, "rate limit exceeded", rule=rule.domain, close=False)
        return rule

    async def _pump_body(self, client: Client, req: Request, rule: DomainRule, limit: int, pace: Pace,
                         on_data: Callable[[bytes], Awaitable[None]], replay: bytes | None = None) -> None:
        """The request body, chunk by chunk, into ``on_data``: read from the client at the minimum rate, or
        ``replay`` (a body read whole already), with the size and upload checks on every chunk."""
        read: list[h11.Event] | None = None
        if replay is not None:
            read = [h11.Data(data=replay), h11.EndOfMessage()] if replay else [h11.EndOfMessage()]
        while True:
            try:
                event = read.pop(0) if read is not None else await client.next_event(pace.remaining)
            except TimeoutError:
                raise Deny(408, "request body below the minimum rate", rule=rule.domain) from None
            except h11.RemoteProtocolError:
                raise Deny(400, "malformed request body") from None
            if isinstance(event, h11.Data):
                data = bytes(event.data)
                req.bytes_out += len(data)
                pace.add(len(data))
                if req.bytes_out > limit:
                    raise Deny(413, f"request body over {limit} bytes", rule=rule.domain)
                check_upload(rule, req.bytes_out)
                await on_data(data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise Deny(400, "request body ended early")

    async def _read_body(self, sbx: SandboxEgress, client: Client, req: Request, rule: DomainRule, limit: int
                         ) -> tuple[bytes, int]:
        """The whole request body (a request held for approval, or one whose size decides whether it is
        held), and the bytes reserved from the sandbox's budget for it, which the caller releases."""
        budget = sbx.budget
        assert budget is not None
        pace = Pace(self.limits.min_rate, self.limits.rate_grace)
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]), left=pace.remaining)
        chunks: list[bytes] = []
        reserved = 0

        async def keep(data: bytes) -> None:
            nonlocal reserved
            try:
                await budget.reserve(len(data), self.limits.head_timeout)
            except TimeoutError:
                raise Deny(503, "egress buffer budget exhausted", rule=rule.domain) from None
            reserved += len(data)
            chunks.append(data)

        try:
            await self._pump_body(client, req, rule, limit, pace, keep)
        except BaseException:
            budget.release(reserved)
            raise
        req.bytes_out = 0  # counted again as it is sent upstream
        return b"".join(chunks), reserved

    async def _exchange(self, sbx: SandboxEgress, client: Client, up: Upstream, req: Request,
                        rule: DomainRule, length: int | None, limit: int, body: bytes | None
                        ) -> tuple[int, int]:
        """Send the request (streaming its body, or ``body`` when it was read already) and stream the
        response back; (status, body bytes)."""
        assert sbx.budget is not None
        patterns = self.credentials.patterns(sbx) if sbx.is_bound(req.host) else None
        # The most this exchange buffers at once: a read chunk in each direction plus the redaction window.
        hold = 2 * self.limits.read_chunk + (patterns.window if patterns else 0)
        try:
            await sbx.budget.reserve(hold, self.limits.head_timeout)
        except TimeoutError:
            raise Deny(503, "egress buffer budget exhausted", rule=rule.domain) from None
        try:
            await self._send_request(sbx, client, up, req, rule, length, limit, patterns is not None, body)
            return await relay_response(client, up, req, rule, sbx.policy.response_limit(rule), patterns,
                                        sbx.budget, self.limits)
        except (OSError, TimeoutError, h11.RemoteProtocolError, ssl.SSLError) as exc:
            raise Deny(502, f"upstream error: {exc.__class__.__name__}", rule=rule.domain) from None
        finally:
            sbx.budget.release(hold)

    async def _send_request(self, sbx: SandboxEgress, client: Client, up: Upstream, req: Request,
                            rule: DomainRule, length: int | None, limit: int, bound: bool, body: bytes | None
                            ) -> None:
        headers = [(k, v) for k, v in req.headers if k not in HOP_BY_HOP and k != b"expect"]
        if bound:
            # Redaction reads the response body: every response from a bound destination comes unencoded.
            headers = [(k, v) for k, v in headers if k != b"accept-encoding"]
            headers.append((b"accept-encoding", b"identity"))
        if length is None:
            headers.append((b"transfer-encoding", b"chunked"))
        elif length or req.method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", str(length).encode()))
        pace = Pace(self.limits.min_rate, self.limits.rate_grace)
        try:
            head = h11.Request(method=req.method, target=req.path, headers=headers)
        except h11.LocalProtocolError:
            # Its message quotes the offending header value, which may hold a secret: never pass it on.
            raise Deny(400, "request cannot be framed for the upstream") from None
        await up.send(head, pace.remaining)
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]), left=pace.remaining)
        scan = PlaceholderScan(sbx.placeholders)

        async def forward(data: bytes) -> None:
            scan.check(data)
            await up.send(h11.Data(data=data), pace.remaining)

        await self._pump_body(client, req, rule, limit, pace, forward, body)
        await up.send(h11.EndOfMessage(), pace.remaining)

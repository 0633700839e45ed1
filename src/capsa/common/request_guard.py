"""The outermost layer of capsa's HTTP APIs (the control plane's and the node's): what a request may cost
before any route sees it.

FastAPI reads and parses a route's declared body before the route's dependencies (authentication among
them) run, so without this layer anyone could make the process read and hold any body. :class:`RequestGuard`
is a pure ASGI middleware; for each request, in this order:

1. the per-client rate limit (``RequestLimits.rate_limit``, keyed by client address): 429 ``rate_limited``;
2. the in-flight bound (``max_in_flight``, HTTP requests and WebSockets): 503 ``overloaded``;
3. for a request that carries a body: a declared ``Content-Length`` over its route's limit is answered 413
   ``payload_too_large`` (read and dropped first only when the gate accepts the caller and the excess is
   within ``drain_bytes``, so the caller can read the answer); then the app's :data:`Gate` checks the
   caller's credential (401, or whatever it
   refuses with); then a route that reads its body whole must find room for it in ``body_memory_bytes``
   (503 ``overloaded``). All of this happens before a byte of the body is read.
4. the body is counted as the app reads it: when a chunked body passes its route's limit, the client gets
   413 at once, the app sees the client go away (``http.disconnect``), and nothing more is read.

Refusals are ``application/problem+json`` with a stable ``code`` and ``Connection: close`` (so the server
reads nothing more of the connection). :class:`BodyRule` gives routes that legitimately take large bodies
(uploads streamed to a sandbox) their own limits.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from limits.aio.storage import MemoryStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capsa.common.asgi import ConnectionMiddleware
from capsa.common.errors import CapsaError
from capsa.common.request_limits import RequestLimits

__all__ = ["BodyRule", "Gate", "RequestGuard", "host_under", "hostname", "problem"]

log = logging.getLogger(__name__)

Gate = Callable[[Scope], Awaitable[CapsaError | None]]
"""Checks the credential of a request that carries a body, before any of the body is read: the error to
refuse it with, or None to let it through (the route still authenticates and authorizes it as before)."""


def hostname(host: str) -> str:
    """``host`` (a Host header or a configured domain) without its port, lower case, no trailing dot."""
    if host.startswith("["):
        return host.lower()
    return host.rsplit(":", 1)[0].lower().rstrip(".") if ":" in host else host.lower().rstrip(".")


def host_under(scope: Scope, domain: str) -> bool:
    """Whether the request's ``Host`` (its port left aside) is a name under ``domain`` (its port too)."""
    return hostname(Headers(scope=scope).get("host", "")).endswith("." + hostname(domain))


@dataclass(frozen=True)
class BodyRule:
    """Requests with a method in ``methods`` whose path matches ``path`` (a regular expression matched
    against the whole path), and, with ``host``, whose ``Host`` is under that domain, may carry up to
    ``limit`` bytes (None: no limit of this layer's). ``streamed``: the route passes its body on as it
    arrives and never holds it whole, so it reserves no memory."""

    path: str
    methods: frozenset[str]
    limit: int | None
    streamed: bool = True
    host: str | None = None
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", re.compile(self.path))

    def matches(self, scope: Scope) -> bool:
        return (scope["method"] in self.methods and self._pattern.fullmatch(scope["path"]) is not None
                and (self.host is None or host_under(scope, self.host)))


def problem(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The problem+json answer of a refusal, closing the connection."""
    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    body = {"type": f"https://capsa.dev/errors/{code}", "title": title, "status": status, "detail": detail,
            "code": code}
    return JSONResponse(body, status_code=status, media_type="application/problem+json",
                        headers={**(headers or {}), "Connection": "close"})


def _refusal(error: CapsaError) -> JSONResponse:
    headers: dict[str, str] = dict(getattr(error, "headers", None) or {})
    return problem(error.status, error.code, error.message, headers)


class _TooLarge(CapsaError):
    code, status = "payload_too_large", 413


class _Overloaded(CapsaError):
    code, status = "overloaded", 503

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": "1"}


class _RateLimited(CapsaError):
    code, status = "rate_limited", 429

    def __init__(self, retry_after: int) -> None:
        super().__init__("too many requests from this address")
        self.headers = {"Retry-After": str(retry_after)}


def _announced_body(headers: Headers) -> tuple[bool, int | None]:
    """Whether a request carries a body, and its length when it declares one (None: chunked). Raises
    ValueError on a malformed length."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return True, None
    length = headers.get("content-length")
    if length is None:
        return False, None
    if not length.strip().isdigit():
        raise ValueError(length)
    return int(length) > 0, int(length)


class RequestGuard(ConnectionMiddleware):
    """See the module's documentation. ``gate`` checks credentials before a body is read; ``rules`` give
    routes their own body limits (the first that matches; otherwise ``limits.max_body_bytes``, read
    whole); ``rate_exempt`` says which requests the per-client rate limit does not count."""

    def __init__(self, app: ASGIApp, *, limits: RequestLimits, gate: Gate | None = None,
                 rules: Sequence[BodyRule] = (), rate_exempt: Callable[[Scope], bool] | None = None) -> None:
        super().__init__(app)
        self.limits = limits
        self.gate = gate
        self.rules = tuple(rules)
        self.rate_exempt = rate_exempt
        self.in_flight = 0
        """Requests and WebSockets being served now."""
        self.body_bytes_held = 0
        """Bytes reserved for bodies that routes read whole, now."""
        self._rate = limits.rate_item()
        self._limiter = SlidingWindowCounterRateLimiter(MemoryStorage()) if self._rate else None

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = await self._rate_refusal(scope)
        if refused is None and self.in_flight >= self.limits.max_in_flight:
            refused = _Overloaded("too many requests in flight; try again shortly")
        if refused is not None:
            await self._refuse(scope, receive, send, refused)
            return
        self.in_flight += 1
        try:
            if scope["type"] == "websocket":
                await self.app(scope, receive, send)
            else:
                await self._http(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _rate_refusal(self, scope: Scope) -> CapsaError | None:
        if self._limiter is None or self._rate is None:
            return None
        if self.rate_exempt is not None and self.rate_exempt(scope):
            return None
        client = scope.get("client")
        key = str(client[0]) if client else "local"
        if await self._limiter.hit(self._rate, key):
            return None
        stats = await self._limiter.get_window_stats(self._rate, key)
        return _RateLimited(max(1, math.ceil(stats.reset_time - time.time())))

    def _rule(self, scope: Scope) -> tuple[int | None, bool]:
        for rule in self.rules:
            if rule.matches(scope):
                return rule.limit, rule.streamed
        return self.limits.max_body_bytes, False

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            has_body, length = _announced_body(Headers(scope=scope))
        except ValueError:
            await _refusal(CapsaError("malformed Content-Length", code="bad_request", status=400))(
                scope, receive, send)
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        limit, streamed = self._rule(scope)
        if limit is not None and length is not None and length > limit:
            if length <= limit + self.limits.drain_bytes and self.gate is not None \
                    and await self.gate(scope) is None:
                await _drain(receive)  # bounded by the declared length: a known caller reads its 413
            await _refusal(_TooLarge(f"body larger than {limit} bytes"))(scope, receive, send)
            return
        if self.gate is not None:
            refused = await self.gate(scope)
            if refused is not None:
                await _refusal(refused)(scope, receive, send)
                return
        reserve = 0
        if not streamed:
            reserve = length if length is not None else (limit or self.limits.max_body_bytes)
            if self.body_bytes_held + reserve > self.limits.body_memory_bytes:
                await _refusal(_Overloaded("too many request bodies in flight; try again shortly"))(
                    scope, receive, send)
                return
        self.body_bytes_held += reserve
        try:
            await _CountedBody(self.app, limit).run(scope, receive, send)
        finally:
            self.body_bytes_held -= reserve

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: CapsaError) -> None:
        response = _refusal(error)
        if scope["type"] == "http":
            await response(scope, receive, send)
            return
        # A WebSocket: refused during the handshake, with an HTTP answer where the server can send one.
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            await response(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1013, "reason": error.code})


class _CountedBody:
    """One request through the app, its body counted as the app reads it and cut at ``limit``."""

    def __init__(self, app: ASGIApp, limit: int | None) -> None:
        self.app = app
        self.limit = limit
        self.received = 0
        self.cut = False
        self.started = False

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted_receive() -> Message:
            if self.cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.limit is not None and self.received > self.limit:
                    self.cut = True
                    if not self.started:
                        self.started = True
                        await _refusal(_TooLarge(f"body larger than {self.limit} bytes"))(
                            scope, _nothing, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if self.cut:
                return  # the 413 went out (or the answer was under way): the app's answer is dropped
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not self.cut:
                raise
            # The app failed on the disconnect it was shown; the client has its 413 already.
            log.debug("request cut at %s bytes: the route ended with an error", self.limit, exc_info=True)


async def _drain(receive: Receive) -> None:
    """Read the request's body to its end and drop it (the server stops at the declared length)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _nothing() -> dict[str, Any]:
    return {"type": "http.disconnect"}

"""ASGI middleware: gives every HTTP request an id (``X-Request-Id`` on the response) and writes its
``api`` audit event, with the events noted while it ran (:func:`capsa.control.audit.trail.note`), into
the caller's tenant chain when the response's last body message goes out. Writes go through the
replica's :class:`~capsa.control.audit.writer.AuditWriter` (group commit: requests finishing together
share one transaction). With ``CAPSA_AUDIT_ACK=durable`` that last message waits until the events are
committed (a client that has read the whole response finds them recorded); with ``async`` (the default)
it goes out at once and the events are committed moments later (reads of the trail through this replica
wait for them).

Requests that never authenticate (health checks, wrong keys) belong to no tenant and are not chained.
A failing audit write is logged and does not change the answer: the effect has already happened.

The same layer binds the request's log context (:func:`capsa.common.logs.log_scope`): every line logged
while the request runs carries its ``request_id`` (and ``upstream_request_id``, an ``X-Request-Id`` the
caller or an ingress sent, when it looks like an id: the trail keeps capsa's own), and counts the request
in the replica's metrics (:meth:`~capsa.control.metrics.ControlMetrics.request_done`, by route template).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capsa.common.asgi import ConnectionMiddleware
from capsa.common.ids import new_id
from capsa.common.logs import REQUEST_ID_HEADER, header_id, log_scope
from capsa.control.audit import trail as audit_trail
from capsa.control.audit.trail import AuditEntry, RequestAudit
from capsa.control.metrics import route_label
from capsa.control.plane import ControlPlane

__all__ = ["REQUEST_ID_HEADER", "AuditMiddleware"]

log = logging.getLogger(__name__)


def _route_template(scope: Scope) -> str | None:
    """The path with each path parameter's value put back as ``{name}`` (``/v1/sessions/{session_id}``);
    None when no route matched. Built from the request rather than the router, whose route objects do
    not carry include prefixes in every FastAPI version."""
    if scope.get("route") is None:
        return None
    params = scope.get("path_params") or {}
    names = {str(v): k for k, v in params.items() if isinstance(v, str | int) and str(v)}
    path = str(scope.get("path", ""))
    return "/".join("{" + names[part] + "}" if part in names else part for part in path.split("/"))


class AuditMiddleware(ConnectionMiddleware):
    def __init__(self, app: ASGIApp, plane: Callable[[], ControlPlane | None]) -> None:
        super().__init__(app)
        self.plane = plane

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = RequestAudit(request_id=new_id("req"))
        token = audit_trail.bind(context)
        started = time.perf_counter()
        status: int | None = None
        written = False

        async def finish(final_status: int | None) -> None:
            nonlocal written
            if written:
                return
            written = True
            seconds = time.perf_counter() - started
            plane = self.plane()
            if plane is not None:
                method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
                plane.metrics.request_done(method, route_label(scope), final_status or 500, seconds)
            await self._write(scope, context, final_status, seconds)

        async def send_with_audit(message: Message) -> None:
            nonlocal status
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = int(message["status"])
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, context.request_id)
            elif kind == "websocket.accept":
                status = 101
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.lower().encode(), context.request_id.encode()))
                message = {**message, "headers": headers}
            elif kind == "http.response.body" and not message.get("more_body", False):
                await finish(status)
            await send(message)

        upstream = header_id(Headers(scope=scope).get(REQUEST_ID_HEADER))
        with log_scope(request_id=context.request_id, upstream_request_id=upstream):
            try:
                await self.app(scope, receive, send_with_audit)
            finally:
                try:
                    await finish(status if status is not None else 500)
                finally:
                    audit_trail.unbind(token)

    async def _write(self, scope: Scope, context: RequestAudit, status: int | None, seconds: float) -> None:
        plane = self.plane()
        if plane is None or context.tenant is None:
            return
        path_params = scope.get("path_params") or {}
        session_id = path_params.get("session_id") if isinstance(path_params, dict) else None
        session_id = session_id if isinstance(session_id, str) and session_id.startswith("ses_") else None
        detail: dict[str, object] = {
            "method": scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET",
            "route": _route_template(scope), "path": scope.get("path"), "status": status,
            "outcome": "ok" if status is not None and status < 400 else "error",
            "duration_ms": round(seconds * 1000, 3),
        }
        if context.error_code:
            detail["code"] = context.error_code
        api = AuditEntry("api", "call", session_id=session_id or context.session_id, detail=detail,
                         key_id=context.key_id, request_id=context.request_id)
        writer = plane.audit
        waits = plane.settings.audit_ack != "async" or writer.behind
        done = writer.submit(context.tenant, [api, *context.events], urgent=waits)
        if not waits:
            done.add_done_callback(functools.partial(_log_failure, context.request_id))
            return
        try:
            await asyncio.shield(done)  # a cancelled request does not cancel the others' write
        except Exception:
            log.exception("could not write the audit events of request %s", context.request_id)


def _log_failure(request_id: str, done: asyncio.Future[None]) -> None:
    if not done.cancelled() and (exc := done.exception()) is not None:
        log.error("could not write the audit events of request %s", request_id, exc_info=exc)

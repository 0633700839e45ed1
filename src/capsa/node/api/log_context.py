"""The node API's log context: every line logged while a call runs carries the ``request_id`` and
``session_id`` the control plane sent with it (:data:`~capsa.common.logs.REQUEST_ID_HEADER`,
:data:`~capsa.common.logs.SESSION_ID_HEADER`) and, on the sandbox routes, the ``sandbox_id`` (see
:mod:`capsa.common.logs`). Header values that do not look like ids are left out."""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from capsa.common.asgi import ConnectionMiddleware
from capsa.common.logs import REQUEST_ID_HEADER, SESSION_ID_HEADER, header_id, log_scope

__all__ = ["LogContext"]

_SANDBOX = re.compile(r"/node/v1/sandboxes/([^/]+)")


class LogContext(ConnectionMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        sandbox = _SANDBOX.match(scope["path"])
        with log_scope(request_id=header_id(headers.get(REQUEST_ID_HEADER)),
                       session_id=header_id(headers.get(SESSION_ID_HEADER)),
                       sandbox_id=header_id(sandbox.group(1)) if sandbox else None):
            await self.app(scope, receive, send)

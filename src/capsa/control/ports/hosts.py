"""Where a session's port is served: a host of its own under ``CAPSA_PORTS_DOMAIN``, or the API's path route.

With a ports domain (``ports.example.com``) port ``8080`` of session ``ses_…`` is
``http(s)://8080-ses_….ports.example.com/``: an origin of its own, so the app's cookies, storage, service
workers and scripts never share an origin with the API or with another session or port (E2B's
``<port>-<id>.<domain>`` model). :class:`PortHostRouter`, in front of the app, sends every request whose
``Host`` is under that domain to the port proxy alone (never to an API route): the path is the app's,
``/v1/sessions/{id}/ports/{port}`` is put in front of it, and :data:`HOST_SCOPE_KEY` tells the proxy the
request came by host. A host under the domain that names no port and session answers 404.

Without one, a port is ``<API>/v1/sessions/{id}/ports/{port}/``: the app's pages share the API's origin,
which the proxy makes safe as far as headers can (:mod:`capsa.control.ports.headers`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from capsa.common.asgi import ConnectionMiddleware
from capsa.common.ids import is_id
from capsa.common.request_guard import hostname
from capsa.control.problems import problem_response

__all__ = ["HOST_SCOPE_KEY", "PortHost", "PortHostRouter", "on_port_host", "parse_port_host", "port_base_url",
           "port_path"]

HOST_SCOPE_KEY = "capsa.port_host"
"""Set in the ASGI scope of a request that reached a port by its host (:class:`PortHostRouter`)."""
_LABEL_RE = re.compile(r"^([1-9][0-9]{0,4})-([a-z]{2,5}_[0-9a-z]{20})$")


@dataclass(frozen=True)
class PortHost:
    session_id: str
    port: int


def port_path(session_id: str, port: int) -> str:
    """The path route of a port on the API's origin."""
    return f"/v1/sessions/{session_id}/ports/{port}/"


def parse_port_host(host: str, domain: str) -> PortHost | None:
    """The port and session a ``Host`` header names under ``domain``; None when it is not under it.
    Raises ValueError when it is under it but names no port of a session."""
    name, suffix = hostname(host), "." + hostname(domain)
    if not name.endswith(suffix):
        return None
    match = _LABEL_RE.match(name[: -len(suffix)])
    if match is None or not is_id(match[2], "ses") or not 1 <= int(match[1]) <= 65535:
        raise ValueError(f"{name} names no port of a session (<port>-<session id>{suffix})")
    return PortHost(match[2], int(match[1]))


def port_base_url(api_base: str, ports_domain: str | None, session_id: str, port: int) -> str:
    """The URL (ending in ``/``) at which clients reach ``port`` of ``session_id``: its own host under
    ``ports_domain`` (the scheme of ``api_base``), or the path route under ``api_base``."""
    if ports_domain:
        scheme = urlsplit(api_base).scheme or "http"
        return f"{scheme}://{port}-{session_id}.{ports_domain}/"
    return api_base.rstrip("/") + port_path(session_id, port)


def on_port_host(conn: HTTPConnection) -> bool:
    """Whether the request reached its port by host (not by the API's path route)."""
    return bool(conn.scope.get(HOST_SCOPE_KEY))


class PortHostRouter(ConnectionMiddleware):
    """ASGI middleware: requests whose ``Host`` is under ``domain`` go to ``ports_app`` (an app holding
    only the port proxy's routes), with the port's path route put in front of their path; every other
    request goes on to ``app``."""

    def __init__(self, app: ASGIApp, *, domain: str, ports_app: ASGIApp) -> None:
        super().__init__(app)
        self.domain = domain
        self.ports_app = ports_app

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = Headers(scope=scope).get("host", "")
        try:
            named = parse_port_host(host, self.domain)
        except ValueError as exc:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await problem_response(404, "not_found", str(exc))(scope, receive, send)
            return
        if named is None:
            await self.app(scope, receive, send)
            return
        prefix = port_path(named.session_id, named.port).rstrip("/")
        path = scope.get("path") or "/"
        raw = scope.get("raw_path") or path.encode()
        await self.ports_app({**scope, "path": prefix + path, "raw_path": prefix.encode() + raw,
                              "root_path": "", HOST_SCOPE_KEY: True}, receive, send)

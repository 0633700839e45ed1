"""The control plane's side of :mod:`capsa.common.request_guard`: which credential each kind of route takes,
checked before a body is read, and the routes whose bodies may be larger than ``max_body_bytes``.

The gate runs only for requests that carry a body, and only checks that the credential the route will
accept is valid (API keys from the replica's key cache); the route then authenticates and authorizes as
before. Credentials by route:

- ``/v1/…``, ``/mcp`` and anything else: ``Authorization: Bearer <API key>``;
- ``/v1/nodes/enrol``: a one-time enrolment token that is still usable;
- ``/v1/nodes/{id}/register|heartbeat|leave|connections/…``: that node's credential or an API key;
- ``/e2b/…``: ``X-API-KEY``; ``/e2b/envd/…``: ``X-Access-Token`` (or ``X-API-KEY``), as in
  :mod:`capsa.compat.e2b.access`;
- none: ``/v1/health``, ``/v1/ready``, ``/v1/connections/callback`` (bodiless public routes) and the port
  proxy (``/v1/sessions/{id}/ports/{port}/…`` and hosts under ``ports_domain``), which checks its port
  token or API key itself before it reads (and streams on) a body.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import Scope

from capsa.common.errors import CapsaError
from capsa.common.request_guard import BodyRule, Gate, RequestGuard, host_under
from capsa.common.request_limits import COMMAND_BODY_BYTES, RequestLimits
from capsa.compat.e2b import access as e2b_access
from capsa.compat.e2b.connect import MAX_MESSAGE_BYTES
from capsa.control import nodes
from capsa.control.auth import authenticate_cached, bearer_token
from capsa.control.errors import ApiError
from capsa.control.plane import ControlPlane
from capsa.control.routes.commands import MAX_STDIN_BODY
from capsa.control.settings import ControlSettings
from capsa.sdk.e2b import E2B_ENVD_PATH, E2B_MOUNT_PATH

__all__ = ["MCP_BODY_BYTES", "body_rules", "credential_gate", "install_request_guard"]

_ANY = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_PUBLIC = re.compile(r"/v1/(health|ready|connections/callback)")
_PORT = re.compile(r"/v1/sessions/[^/]+/ports/[0-9]+/.*")
_PORT_TOKENS = re.compile(r"/v1/sessions/[^/]+/ports/[0-9]+/tokens(/[^/]+)?")
_NODE_OWN = re.compile(r"/v1/nodes/([^/]+)/(register|heartbeat|leave|connections/[^/]+/token)")
_ENROL = "/v1/nodes/enrol"
_ENVD = E2B_MOUNT_PATH + E2B_ENVD_PATH


def _port_route(scope: Scope, ports_domain: str | None) -> bool:
    """Whether the request goes to the port proxy (by its path, or by a host under ``ports_domain``)."""
    if ports_domain and host_under(scope, ports_domain):
        return True
    path, method = scope["path"], scope["method"]
    if _PORT_TOKENS.fullmatch(path) and method in ("POST", "DELETE"):
        return False  # creating or revoking a port token: an API key route
    return _PORT.fullmatch(path) is not None


MCP_BODY_BYTES = 4 << 20
"""Largest MCP request over HTTP: the MCP SDK's default limit, so a tool call the transport would take is
never cut here first."""


def credential_gate(plane: Callable[[], ControlPlane | None], ports_domain: str | None = None) -> Gate:
    """The gate: the refusal for a request whose credential its route would not accept."""

    async def gate(scope: Scope) -> CapsaError | None:
        path = scope["path"]
        if _PUBLIC.fullmatch(path) or _port_route(scope, ports_domain):
            return None
        control = plane()
        if control is None:
            return ApiError("the control plane is starting", code="not_ready", status=503)
        headers = Headers(scope=scope)
        token = bearer_token(headers.get("authorization"))
        try:
            if path == _ENROL:
                await nodes.check_enrol_token(control, token)
            elif path == E2B_MOUNT_PATH or path.startswith(E2B_MOUNT_PATH + "/"):
                await e2b_access.check_credential(control, path[len(E2B_MOUNT_PATH):], headers)
            elif (node := _NODE_OWN.fullmatch(path)) and token and not token.startswith("csk_"):
                await nodes.check_node_credential(control, node.group(1), token)
            else:
                await authenticate_cached(control.db, control.keys, token)
        except CapsaError as exc:
            return exc
        return None

    return gate


def body_rules(settings: ControlSettings) -> list[BodyRule]:
    """The routes whose bodies may pass ``max_body_bytes``: uploads streamed to a sandbox (up to
    ``max_file_bytes``), stdin writes and command requests (read whole), envd messages."""
    files = settings.max_file_bytes
    return [
        BodyRule(r"/v1/sessions/[^/]+/files/(content|archive)", frozenset({"PUT"}), files),
        BodyRule(r"/v1/sessions/[^/]+/ports/[0-9]+/.*", _ANY, files),
        BodyRule(r"/v1/sessions/[^/]+/processes/[^/]+/stdin", frozenset({"POST"}), MAX_STDIN_BODY,
                 streamed=False),
        BodyRule(r"/v1/sessions/[^/]+/commands", frozenset({"POST"}), COMMAND_BODY_BYTES, streamed=False),
        # MCP over HTTP: the MCP SDK's own request limit (4 MiB), which its transport enforces too.
        BodyRule(r"/mcp/?", frozenset({"POST"}), MCP_BODY_BYTES, streamed=False),
        BodyRule(re.escape(_ENVD) + r"/files", frozenset({"POST"}), files),
        BodyRule(re.escape(_ENVD) + r"/process\.Process/StreamInput", frozenset({"POST"}), files),
        BodyRule(re.escape(_ENVD) + r"/(process\.Process|filesystem\.Filesystem)/[^/]+", frozenset({"POST"}),
                 MAX_MESSAGE_BYTES + 5, streamed=False),
    ]


def install_request_guard(app: FastAPI, settings: ControlSettings,
                          limits: RequestLimits | None = None) -> None:
    """Put the guard in front of everything ``app`` serves (/v1, /e2b, /mcp, port hosts): call it after
    every other middleware is added, so it is the outermost."""
    ports_domain = settings.ports_domain
    rules = body_rules(settings)
    if ports_domain:  # a port's own host: any path is the app's, streamed by the port proxy
        rules.insert(0, BodyRule(".*", _ANY, settings.max_file_bytes, host=ports_domain))

    def plane() -> ControlPlane | None:
        found = getattr(app.state, "plane", None)
        return found if isinstance(found, ControlPlane) else None

    app.add_middleware(RequestGuard, limits=limits or RequestLimits(),
                       gate=credential_gate(plane, ports_domain), rules=rules)

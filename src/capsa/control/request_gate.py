"""The control plane's side of :mod:`capsa.common.request_guard`: which credential each kind of route takes,
checked before a body is read, and the routes whose bodies may be larger than ``max_body_bytes``.

The gate runs only for requests that carry a body, and only checks that the credential the route will
accept is valid (API keys from the replica's key cache); the route then authenticates and authorizes as
before. Credentials by route:

- ``/v1/…`` and anything else: ``Authorization: Bearer <API key>``;
- ``/v1/nodes/enrol``: a one-time enrolment token that is still usable;
- ``/v1/nodes/{id}/register|heartbeat|leave|connections/…``: that node's credential or an API key;
- a front end's paths (:class:`~capsa.control.front_ends.FrontEndGate`, given by the composition root:
  ``/e2b/…``, ``/mcp``): its own check, else an API key as above;
- none: ``/v1/health``, ``/v1/ready``, ``/v1/connections/callback`` (bodiless public routes) and the port
  proxy (``/v1/sessions/{id}/ports/{port}/…`` and hosts under ``ports_domain``), which checks its port
  token or API key itself before it reads (and streams on) a body.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import Scope

from capsa.common.errors import CapsaError
from capsa.common.request_guard import BodyRule, Gate, RequestGuard, host_under
from capsa.common.request_limits import COMMAND_BODY_BYTES, RequestLimits
from capsa.control.auth import authenticate_cached, bearer_token
from capsa.control.errors import ApiError
from capsa.control.front_ends import FrontEndGate
from capsa.control.nodes import registry as nodes
from capsa.control.plane import ControlPlane
from capsa.control.routes.commands import MAX_STDIN_BODY
from capsa.control.settings import ControlSettings

__all__ = ["body_rules", "credential_gate", "install_request_guard"]

_ANY = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_PUBLIC = re.compile(r"/v1/(health|ready|connections/callback)")
_PORT = re.compile(r"/v1/sessions/[^/]+/ports/[0-9]+/.*")
_PORT_TOKENS = re.compile(r"/v1/sessions/[^/]+/ports/[0-9]+/tokens(/[^/]+)?")
_NODE_OWN = re.compile(r"/v1/nodes/([^/]+)/(register|heartbeat|leave|connections/[^/]+/token)")
_ENROL = "/v1/nodes/enrol"


def _port_route(scope: Scope, ports_domain: str | None) -> bool:
    """Whether the request goes to the port proxy (by its path, or by a host under ``ports_domain``)."""
    if ports_domain and host_under(scope, ports_domain):
        return True
    path, method = scope["path"], scope["method"]
    if _PORT_TOKENS.fullmatch(path) and method in ("POST", "DELETE"):
        return False  # creating or revoking a port token: an API key route
    return _PORT.fullmatch(path) is not None


def _front_end(gates: Sequence[FrontEndGate], path: str) -> FrontEndGate | None:
    for gate in gates:
        if path == gate.prefix or path.startswith(gate.prefix + "/"):
            return gate
    return None


def credential_gate(plane: Callable[[], ControlPlane | None], ports_domain: str | None = None,
                    front_ends: Sequence[FrontEndGate] = ()) -> Gate:
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
            elif (front := _front_end(front_ends, path)) is not None and front.check is not None:
                await front.check(control, path[len(front.prefix):], headers)
            elif (node := _NODE_OWN.fullmatch(path)) and token and not token.startswith("csk_"):
                await nodes.check_node_credential(control, node.group(1), token)
            else:
                await authenticate_cached(control.db, control.keys, token)
        except CapsaError as exc:
            return exc
        return None

    return gate


def body_rules(settings: ControlSettings, front_ends: Sequence[FrontEndGate] = ()) -> list[BodyRule]:
    """The routes whose bodies may pass ``max_body_bytes``: uploads streamed to a sandbox (up to
    ``max_file_bytes``), stdin writes and command requests (read whole), and the front ends' own."""
    files = settings.max_file_bytes
    return [
        BodyRule(r"/v1/sessions/[^/]+/files/(content|archive)", frozenset({"PUT"}), files),
        BodyRule(r"/v1/sessions/[^/]+/ports/[0-9]+/.*", _ANY, files),
        BodyRule(r"/v1/sessions/[^/]+/processes/[^/]+/stdin", frozenset({"POST"}), MAX_STDIN_BODY,
                 streamed=False),
        BodyRule(r"/v1/sessions/[^/]+/commands", frozenset({"POST"}), COMMAND_BODY_BYTES, streamed=False),
        *(rule for gate in front_ends for rule in gate.rules),
    ]


def install_request_guard(app: FastAPI, settings: ControlSettings, limits: RequestLimits | None = None,
                          front_ends: Sequence[FrontEndGate] = ()) -> None:
    """Put the guard in front of everything ``app`` serves (/v1, the front ends, port hosts): call it
    after every other middleware is added, so it is the outermost."""
    ports_domain = settings.ports_domain
    rules = body_rules(settings, front_ends)
    if ports_domain:  # a port's own host: any path is the app's, streamed by the port proxy
        rules.insert(0, BodyRule(".*", _ANY, settings.max_file_bytes, host=ports_domain))

    def plane() -> ControlPlane | None:
        found = getattr(app.state, "plane", None)
        return found if isinstance(found, ControlPlane) else None

    app.add_middleware(RequestGuard, limits=limits or RequestLimits(),
                       gate=credential_gate(plane, ports_domain, front_ends), rules=rules)

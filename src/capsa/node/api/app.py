"""Assembles the node API: every resource's router behind the node token, and the error handlers."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import Depends, FastAPI
from starlette.datastructures import Headers
from starlette.types import Scope

from capsa.common.errors import CapsaError
from capsa.common.node_api import EXEC_EVENT
from capsa.common.request_guard import BodyRule, RequestGuard
from capsa.common.request_limits import COMMAND_BODY_BYTES, RequestLimits
from capsa.node.agent.agent import NodeAgent
from capsa.node.api import (
    approvals,
    commands,
    egress,
    files,
    node,
    ports,
    sandboxes,
    snapshots,
    templates,
    terminals,
)
from capsa.node.api.commands import MAX_STDIN_WRITE
from capsa.node.api.deps import bearer_matches, require_node_token
from capsa.node.api.errors import install_error_handlers
from capsa.node.api.log_context import LogContext

__all__ = ["BODY_RULES", "PREFIX", "create_node_app"]

PREFIX = "/node/v1"


class _NodeApp(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """FastAPI's document plus ``ExecEvent``, the schema of one line of the exec event stream."""
        if self.openapi_schema is None:
            document = super().openapi()
            event = EXEC_EVENT.json_schema(mode="serialization", ref_template="#/components/schemas/{model}")
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(event.pop("$defs", {}))
            schemas["ExecEvent"] = event
            self.openapi_schema = document
        return self.openapi_schema


_SANDBOX = PREFIX + "/sandboxes/[^/]+"
BODY_RULES = (
    # Streamed into the guest; the control plane bounds what it sends (max_file_bytes).
    BodyRule(_SANDBOX + "/files/(content|archive)", frozenset({"PUT"}), None),
    BodyRule(_SANDBOX + "/processes/[^/]+/stdin", frozenset({"POST"}), MAX_STDIN_WRITE, streamed=False),
    BodyRule(_SANDBOX + "/exec", frozenset({"POST"}), COMMAND_BODY_BYTES, streamed=False),
)
"""The node routes whose bodies may pass ``max_body_bytes`` (see capsa.common.request_guard)."""


def _guard(app: FastAPI, token: str, limits: RequestLimits) -> None:
    """The request guard in front of the node API: no body is read without the node token, and the
    per-client rate limit counts only requests without it (the control plane's replicas carry it)."""

    def authorized(scope: Scope) -> bool:
        return bearer_matches(Headers(scope=scope).get("authorization"), token)

    async def gate(scope: Scope) -> CapsaError | None:
        if scope["path"] == PREFIX + "/health" or authorized(scope):
            return None
        return CapsaError("missing or wrong node token", code="unauthorized", status=401)

    app.add_middleware(RequestGuard, limits=limits, gate=gate, rules=BODY_RULES, rate_exempt=authorized)


def create_node_app(agent: NodeAgent, token: str, limits: RequestLimits | None = None) -> FastAPI:
    """The node API for ``agent``; every route but ``/node/v1/health`` needs the Bearer ``token``;
    ``limits``: body, concurrency and rate limits (default: ``CAPSA_REQUEST_*``).

    Snapshot, template and pool routes answer ``snapshots_unavailable`` (501) on a node without them."""
    if len(token) < 16:
        raise ValueError("node token must be at least 16 characters")
    app = _NodeApp(title="capsa node agent", version=version("capsa"))
    app.state.agent = agent
    app.state.node_token = token
    install_error_handlers(app)
    app.include_router(node.public, prefix=PREFIX)
    authorized = [Depends(require_node_token)]
    for module in (node, sandboxes, egress, approvals, commands, files, snapshots, templates):
        app.include_router(module.router, prefix=PREFIX, dependencies=authorized)
    app.include_router(node.metrics, dependencies=authorized)
    app.include_router(ports.router, prefix=PREFIX)  # a WebSocket: it checks the node token itself
    app.include_router(terminals.router, prefix=PREFIX)  # so does this one
    _guard(app, token, limits or RequestLimits())
    app.add_middleware(LogContext)  # outermost: the guard's lines carry the call's ids too
    return app

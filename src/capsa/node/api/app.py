"""Assembles the node API: every resource's router behind the node token, and the error handlers."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import Depends, FastAPI

from capsa.common.node_api import EXEC_EVENT
from capsa.node.agent import NodeAgent
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
from capsa.node.api.deps import require_node_token
from capsa.node.api.errors import install_error_handlers

__all__ = ["PREFIX", "create_node_app"]

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


def create_node_app(agent: NodeAgent, token: str) -> FastAPI:
    """The node API for ``agent``; every route but ``/node/v1/health`` needs the Bearer ``token``.

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
    return app

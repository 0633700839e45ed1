"""``capsa serve``: the control plane and one local node in a single process, built from the same two pieces
as ``capsa control`` and ``capsa node``.

This module sits outside ``capsa.control`` and ``capsa.node`` because it is the one place allowed to wire
the two together (import-linter keeps them independent). The control plane reaches the node only through the
node API: its usual :class:`~capsa.control.nodes.client.NodeClient` with the node's app in-process for whole
answers, and the node's Unix socket in the state directory (guarded by a fresh random token) for streams and
WebSockets; the node reaches the control plane through :class:`LocalControlLink`, which calls the control
plane's node registry directly instead of over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

import uvicorn

from capsa.common.audit_checkpoint import ensure_signing_key
from capsa.common.connection_wire import ConnectionTokenOut
from capsa.common.node_wire import HeartbeatOut, NodeHeartbeat, NodeRegister
from capsa.common.service import QuietServer, bind_tcp, wait_started
from capsa.common.settings import Settings
from capsa.control.connections import tokens as connection_tokens
from capsa.control.nodes import registry as nodes
from capsa.control.nodes.client import NodeClient
from capsa.control.plane import ControlPlane
from capsa.control.secretbox import ensure_key_file
from capsa.control.settings import ControlSettings
from capsa.frontends import build_app
from capsa.node.daemon import NodeService
from capsa.node.statedir import prepare_state_dir
from capsa.node.templates.source import TemplateSource

__all__ = ["LOCAL_NODE_ID", "LocalControlLink", "run"]

log = logging.getLogger(__name__)

LOCAL_NODE_ID = "local"


def _announce_key(key: str) -> None:
    # stdout, once: this is the only time the key exists in clear.
    print(f"capsa: bootstrap admin key (shown once, store it now): {key}", flush=True)


class LocalControlLink:
    """The node's link to a control plane in the same process."""

    def __init__(self, plane: ControlPlane, node_id: str) -> None:
        self._plane = plane
        self._node_id = node_id

    async def register(self, req: NodeRegister) -> str:
        await nodes.register_node(self._plane, self._node_id, req)
        return self._node_id

    async def heartbeat(self, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
        return await nodes.heartbeat(self._plane, node_id, req)

    async def leave(self, node_id: str) -> None:
        await nodes.leave_node(self._plane, node_id)

    async def connection_token(self, node_id: str, session_id: str, connection_id: str) -> ConnectionTokenOut:
        return await connection_tokens.token_for_node(self._plane, node_id, session_id, connection_id)

    async def aclose(self) -> None:
        return None



async def run(host: str, port: int, state_dir: Path, database_url: str | None, accel: str) -> None:
    """Serve the HTTP API on ``host:port`` until cancelled, with a local node using ``state_dir``."""
    # Bind first: a taken port must fail before anything else happens, in particular before the
    # database is created and a bootstrap key is generated that would then never be shown again.
    listener = bind_tcp(host, port)
    try:
        await _serve(listener, host, port, state_dir, database_url, accel)
    finally:
        listener.close()



async def _serve(listener: socket.socket, host: str, port: int, state_dir: Path, database_url: str | None,
                 accel: str) -> None:
    from capsa.images.build import ensure_image, find_image
    from capsa.node.assembly import build_node

    state_dir = await asyncio.to_thread(prepare_state_dir, state_dir)
    settings = Settings(state_dir=state_dir, accel=accel)
    image = find_image(settings)
    if image is None:
        log.info("building the guest image (first start only)")
        image = await asyncio.to_thread(ensure_image, settings)

    key_file = await asyncio.to_thread(ensure_key_file, state_dir / "secret.key")
    # One replica: every session transition goes through this process, so its session cache is safe.
    control_settings = ControlSettings(database_url=database_url or f"sqlite+aiosqlite:///{state_dir}/capsa.db",
                                       secret_key_file=key_file)
    if "CAPSA_SESSION_CACHE_SECONDS" not in os.environ:
        control_settings = control_settings.model_copy(update={"session_cache_seconds": 5.0})
    if "CAPSA_AUDIT_SIGNING_KEY_FILE" not in os.environ:  # audit checkpoints signed with a key of its own
        signing_key = await asyncio.to_thread(ensure_signing_key, state_dir / "audit-signing.key")
        control_settings = control_settings.model_copy(update={"audit_signing_key_file": signing_key})
    app = build_app(control_settings, on_bootstrap_key=_announce_key)
    # /v1/ready answers 503 until the local node is ready (its base template in place: restored from the
    # template cache or built) and registered.
    app.state.startup_pending = True
    server = QuietServer(uvicorn.Config(app, host=host, port=port, log_level="info", log_config=None))

    parts = await build_node(settings, image, node_id=LOCAL_NODE_ID)
    service: NodeService | None = None
    server_task: asyncio.Task[None] | None = None
    try:
        server_task = asyncio.create_task(server.serve(sockets=[listener]), name="capsa-api")
        await wait_started(server, server_task, name="API server")
        plane: ControlPlane = app.state.plane
        service = NodeService(parts, LocalControlLink(plane, LOCAL_NODE_ID), uds=state_dir / "node.sock")
        await service.start()
        # The control plane's calls with a whole answer (the session hot path) reach this node in-process.
        plane.nodes.add(NodeClient(service.url, service.api_token, app=service.app,
                                   timeout=control_settings.node_request_timeout))
        app.state.startup_pending = False
        source = parts.agent.source
        if isinstance(source, TemplateSource):
            origin = {"pool": "in the state dir", "cache": "restored from the template cache",
                      "built": "built by a cold boot (now cached)"}.get(source.base_origin or "", "not built")
            log.info("base template %s", origin, extra={"origin": source.base_origin})
        log.info("serving on http://%s:%d (state %s)", host, port, state_dir)
        # Shielded: if run() is cancelled (SIGTERM, SIGINT), the finally block below stops everything.
        await asyncio.shield(server_task)
    finally:
        # The node first, while the control plane still runs: leaving pauses or fails its sessions.
        if service is not None:
            await service.stop()
        else:
            await parts.close()
        if server_task is not None and not server_task.done():
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await server_task

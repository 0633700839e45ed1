"""``capsa serve``: the control plane and one local node agent in a single process.

This module sits outside ``capsa.control`` and ``capsa.node`` because it is the one place allowed to wire
the two together (import-linter keeps them independent). The control plane still reaches the node only over
the node HTTP API, here on a Unix socket in the state directory guarded by a fresh random token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import Generator
from pathlib import Path

import uvicorn

from capsa.common.settings import Settings
from capsa.control.app import create_app
from capsa.control.nodes import heartbeat, register_node
from capsa.control.plane import ControlPlane
from capsa.control.schemas import Capacity, NodeHeartbeat, NodeRegister
from capsa.control.secretbox import ensure_key_file
from capsa.control.settings import ControlSettings
from capsa.node.agent import NodeAgent
from capsa.node.api import create_node_app
from capsa.node.egress.node_egress import NodeEgress

__all__ = ["HEARTBEAT_INTERVAL", "LOCAL_NODE_ID", "run"]

log = logging.getLogger(__name__)

LOCAL_NODE_ID = "local"
HEARTBEAT_INTERVAL = 5.0


class _QuietServer(uvicorn.Server):
    """The node's server: the public server owns the process signals and stops this one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _announce_key(key: str) -> None:
    # stdout, once: this is the only time the key exists in clear.
    print(f"capsa: bootstrap admin key (shown once, store it now): {key}", flush=True)


def _prepare_state_dir(state_dir: Path) -> Path:
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    return state_dir


async def _heartbeats(plane: ControlPlane, agent: NodeAgent) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL)
        try:
            answer = await heartbeat(plane, agent.node_id, NodeHeartbeat(
                capacity=Capacity(**agent.capacity.as_dict()), used=agent.used(),
                failed_sandboxes=agent.failed_sandboxes(), sandboxes=[r.id for r in agent.list()]))
            for sandbox_id in answer.destroy_sandboxes:
                log.warning("destroying sandbox %s: no live session owns it", sandbox_id)
                await agent.destroy(sandbox_id)
        except Exception:
            log.exception("local node heartbeat failed")


async def _wait_started(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    while not server.started:
        if task.done():
            task.result()  # re-raises why it stopped (e.g. the port is taken)
            raise OSError("server stopped before it started")
        await asyncio.sleep(0.05)


async def run(host: str, port: int, state_dir: Path, database_url: str | None, accel: str) -> None:
    """Serve the HTTP API on ``host:port`` until cancelled, with a local node using ``state_dir``."""
    # Bind first: a taken port must fail before anything else happens, in particular before the
    # database is created and a bootstrap key is generated that would then never be shown again.
    listener = _bind(host, port)
    try:
        await _serve(listener, host, port, state_dir, database_url, accel)
    finally:
        listener.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc


async def _serve(listener: socket.socket, host: str, port: int, state_dir: Path, database_url: str | None,
                 accel: str) -> None:
    from capsa.images.build import ensure_image, find_image
    from capsa.node.api_snapshots import add_snapshot_routes
    from capsa.node.pool import PoolSettings
    from capsa.node.runtime.snapshot_runtime import SnapshotRuntime
    from capsa.node.snapshot_agent import SnapshotNodeAgent
    from capsa.node.storage.pool import StoragePool

    state_dir = await asyncio.to_thread(_prepare_state_dir, state_dir)
    settings = Settings(state_dir=state_dir, accel=accel)
    image = find_image(settings)
    if image is None:
        print("capsa: building the guest image (first start only)…", file=sys.stderr, flush=True)
        image = await asyncio.to_thread(ensure_image, settings)

    # Sessions come from template snapshots (warm pool or restore on demand), on the node's storage pool.
    storage = await asyncio.to_thread(StoragePool.from_settings, settings)
    runtime = SnapshotRuntime(settings, accel=accel, pool=storage)
    pool_cfg = PoolSettings()
    # Sandbox namespaces and nftables need root; without it, sessions with a policy are refused
    # (egress_unavailable) and sessions without one run with no network, as always.
    # A namespace prefix of its own per state directory: stable across restarts, so a restarted node
    # removes what a crashed one left, and distinct from other nodes' (and tests') on the same host.
    prefix = "cs" + hashlib.sha256(str(state_dir).encode()).hexdigest()[:8] + "-"
    egress = NodeEgress.create(netns_prefix=prefix) if os.geteuid() == 0 else None
    agent = SnapshotNodeAgent(runtime, image, node_id=LOCAL_NODE_ID, egress=egress, pool_size=pool_cfg.size,
                              pool_sizes=pool_cfg.sizes)
    await agent.start()
    token = secrets.token_urlsafe(32)
    node_socket = state_dir / "node.sock"
    node_socket.unlink(missing_ok=True)
    node_app = create_node_app(agent, token)
    add_snapshot_routes(node_app, agent, token)
    node_server = _QuietServer(uvicorn.Config(node_app, uds=str(node_socket),
                                              log_level="warning", lifespan="off"))
    key_file = await asyncio.to_thread(ensure_key_file, state_dir / "secret.key")
    control_settings = ControlSettings(database_url=database_url or f"sqlite+aiosqlite:///{state_dir}/capsa.db",
                                       secret_key_file=key_file)
    app = create_app(control_settings, on_bootstrap_key=_announce_key)
    app.state.startup_pending = True  # /v1/ready answers 503 until the local node has registered
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))

    node_task = asyncio.create_task(node_server.serve(), name="capsa-node-api")
    server_task: asyncio.Task[None] | None = None
    beats: asyncio.Task[None] | None = None
    try:
        await _wait_started(node_server, node_task)
        node_socket.chmod(0o600)
        server_task = asyncio.create_task(server.serve(sockets=[listener]), name="capsa-api")
        await _wait_started(server, server_task)
        plane: ControlPlane = app.state.plane
        await register_node(plane, NodeRegister(
            id=agent.node_id, url=f"unix://{node_socket}", token=token,
            capacity=Capacity(**agent.capacity.as_dict()), templates=agent.template_store.names()))
        app.state.startup_pending = False
        beats = asyncio.create_task(_heartbeats(plane, agent), name="capsa-heartbeat")
        print(f"capsa: serving on http://{host}:{port} (runtime {runtime.name}, state {state_dir})",
              file=sys.stderr, flush=True)
        # Shielded: if run() is cancelled, the finally block below stops the server gracefully instead.
        await asyncio.shield(server_task)
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        if server_task is not None and not server_task.done():
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await server_task
        node_server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await node_task
        await agent.close()
        await asyncio.to_thread(storage.unmount, lazy=True)
        node_socket.unlink(missing_ok=True)

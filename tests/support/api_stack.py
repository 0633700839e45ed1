"""The whole server side in one test process: control plane + node, each behind a real HTTP server.

The node is the production one (:func:`capsa.node.assembly.assemble_node` and
:class:`capsa.node.daemon.NodeService` with :class:`~capsa.node.daemon.HttpControlLink`, as ``capsa node``
runs them): it serves its API on a Unix socket, the control plane serves on 127.0.0.1 (ephemeral port), both
with uvicorn, and the node registers, fetches connection tokens and leaves over the control plane's API. The
runtime is pluggable: the fake one (real guest daemons as host processes) for fast unit tests, QemuRuntime
for integration tests. The node does not heartbeat by itself: tests call :meth:`ApiStack.heartbeat` (one
beat of the service's loop) when they mean to.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import httpx
import uvicorn
from fastapi import FastAPI

from capsa.common.connection_wire import ConnectionTokenOut
from capsa.common.image import GuestImage
from capsa.common.node_wire import HeartbeatOut, NodeHeartbeat, NodeRegister
from capsa.control.keys import generate_key
from capsa.control.plane import ControlPlane
from capsa.control.settings import ControlSettings
from capsa.frontends import build_app
from capsa.node.agent.agent import NodeAgent
from capsa.node.agent.capacity import NodeCapacity
from capsa.node.agent.snapshots import Snapshots
from capsa.node.assembly import NodeParts, assemble_node
from capsa.node.daemon import IDENTITY_FILE, ControlLinkError, HttpControlLink, NodeIdentity, NodeService
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.trust_store import TrustStore
from capsa.node.guestlink.identity import bind_sandbox
from capsa.node.runtime.base import Runtime, SnapshotCapable, SnapshottingRuntime
from capsa.node.storage.floor import SpaceFloor
from capsa.node.templates.source import ColdBootSource, SandboxSource
from tests.support.fake_runtime import FakeRuntime

__all__ = ["ApiStack", "Replica", "serve_app"]


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


@dataclass
class Replica:
    app: FastAPI
    server: uvicorn.Server
    task: asyncio.Task[None]
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_app(
    app: FastAPI, *, uds: str | None = None, lifespan: Literal["auto", "on", "off"] = "on"
) -> Replica:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, uds=uds, log_level="warning", lifespan=lifespan)
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server did not start")
        await asyncio.sleep(0.01)
    if uds:
        url = f"unix://{uds}"
    else:
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
    return Replica(app, server, task, url)


class _ClaimsEgress:
    """The node's control link, registering as able to run egress policies whatever its egress part, as
    the stack's admin registration claims (the control plane's default): tests of a node refusing a policy
    it cannot run need the control plane to place the session there."""

    def __init__(self, link: HttpControlLink) -> None:
        self._link = link

    async def register(self, req: NodeRegister) -> str:
        return await self._link.register(req.model_copy(update={"egress": True}))

    async def heartbeat(self, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
        return await self._link.heartbeat(node_id, req)

    async def leave(self, node_id: str) -> None:
        await self._link.leave(node_id)

    async def connection_token(self, node_id: str, session_id: str, connection_id: str) -> ConnectionTokenOut:
        return await self._link.connection_token(node_id, session_id, connection_id)

    async def aclose(self) -> None:
        await self._link.aclose()


@dataclass
class ApiStack:
    database_url: str
    runtime: Runtime
    image: GuestImage
    settings: dict[str, Any] = field(default_factory=dict)
    capacity: NodeCapacity = field(default_factory=lambda: NodeCapacity(8192, 32, 16))
    node_id: str = "node-test"
    egress: NodeEgress | None = None
    trust: TrustStore | None = None
    """Where the node puts the egress CA in a guest (host-process guests: somewhere in their /tmp)."""
    source: SandboxSource | None = None
    """Where the agent's sandboxes come from (default: cold boots of ``image``)."""
    snapshots: bool = True
    """Give the agent its snapshots part (when the runtime can snapshot); False: a node without."""
    snapshot_floor: SpaceFloor | None = None
    """The free-space floor the snapshots part keeps (None: none)."""
    admin_key: str = ""
    node_token: str = ""
    """The node's credential (what it presents to the control plane), also its API token until its service
    registers with one of its own."""
    agent: NodeAgent | None = None
    replicas: list[Replica] = field(default_factory=list)
    service: NodeService | None = None
    """The running node (its agent, API server and control link)."""
    _tmp: Path | None = None

    @property
    def url(self) -> str:
        return self.replicas[0].url

    @property
    def plane(self) -> ControlPlane:
        """The first replica's control plane (its state, caches and settings)."""
        plane = self.replicas[0].app.state.plane
        assert isinstance(plane, ControlPlane)
        return plane

    def control_settings(self, **overrides: Any) -> ControlSettings:
        values = {
            "database_url": self.database_url,
            "bootstrap_key": self.admin_key,
            "reaper_interval": 0.2,
            # This stack's node sends no heartbeats by itself (tests call heartbeat() when they mean to),
            # so with the default 30 s a test running that long under load would see its node counted as
            # lost and its sessions paused or failed. Tests of node loss set short ones themselves.
            "node_heartbeat_timeout": 3600.0,
            "node_dead_after_s": 3600.0,
            **self.settings,
            **overrides,
        }
        return ControlSettings(**values)

    async def start(self) -> ApiStack:
        self._tmp = Path(tempfile.mkdtemp(prefix="capsa-stack-"))
        self.admin_key = generate_key().full
        self.node_token = secrets.token_urlsafe(24)
        await self.add_replica()
        parts = await self._assemble(self.source or ColdBootSource(self.runtime, {"base": self.image}))
        async with self.client(self.admin_key) as admin:  # an admin adds the node by hand, under its id
            response = await admin.post(
                "/v1/nodes",
                json={
                    "id": self.node_id,
                    "url": f"unix://{self._socket}",
                    "token": self.node_token,
                    "capacity": {
                        "memory_mib": self.capacity.memory_mib,
                        "vcpus": self.capacity.vcpus,
                        "max_sandboxes": self.capacity.max_sandboxes,
                    },
                    "templates": sorted(parts.agent.templates),
                },
            )
            response.raise_for_status()
        # The node keeps that token as its credential, as an enrolled `capsa node` keeps its own.
        NodeIdentity(self.node_id, self.node_token, self.url).save(self._tmp / IDENTITY_FILE)
        await self._serve(parts)
        return self

    @property
    def _socket(self) -> Path:
        assert self._tmp is not None
        return self._tmp / "node.sock"

    async def _assemble(self, source: SandboxSource) -> NodeParts:
        snapshots = None
        if self.snapshots and isinstance(self.runtime, SnapshotCapable):
            # A fake guest runs on the host: it may not set the clock or hostname (FakeRuntime.bind_identity).
            bind = self.runtime.bind_identity if isinstance(self.runtime, FakeRuntime) else bind_sandbox
            snapshots = Snapshots(cast(SnapshottingRuntime, self.runtime), source.image_for, bind=bind,
                                  floor=self.snapshot_floor)
        parts = await assemble_node(self.runtime, self.image, node_id=self.node_id, source=source,
                                    snapshots=snapshots, egress=self.egress, capacity=self.capacity,
                                    trust=self.trust)
        self.agent = parts.agent
        return parts

    async def _serve(self, parts: NodeParts) -> None:
        """The node's service on ``parts``: it serves its API on the socket and registers with its credential
        (then fetches connection tokens with it). Its heartbeat loop never comes round in a test."""
        assert self._tmp is not None
        link = _ClaimsEgress(HttpControlLink(self.url, self._tmp, enrol_token=None))
        self.service = NodeService(parts, link, uds=self._socket, heartbeat_interval=3600.0)
        await self.service.start()

    async def restart_node(self, runtime: Runtime, egress: NodeEgress | None = None) -> None:
        """What a node process restart does: the node stops (it leaves the control plane; its sandboxes
        die), then a new one on ``runtime`` with ``egress`` serves the same socket under the same id and
        credential, and registers again."""
        assert self.service is not None
        await self.service.stop()
        self.runtime, self.egress = runtime, egress
        await self._serve(await self._assemble(ColdBootSource(self.runtime, {"base": self.image})))

    async def add_replica(self, **overrides: Any) -> Replica:
        replica = await serve_app(build_app(self.control_settings(**overrides)))
        self.replicas.append(replica)
        return replica

    def client(self, key: str | None, url: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=url or self.url, headers=headers, **{"timeout": 120, **kwargs})

    async def tenant_key(self, tenant: str, admin: bool = False) -> str:
        async with self.client(self.admin_key) as client:
            response = await client.post("/v1/keys", json={"tenant": tenant, "admin": admin})
            response.raise_for_status()
            return str(response.json()["key"])

    async def heartbeat(self) -> httpx.Response:
        """One beat of the node's heartbeat loop (report, then destroy what the control plane disowns),
        answered as the control plane's HTTP answer to it."""
        assert self.service is not None
        try:
            answer = await self.service.beat()
        except ControlLinkError as exc:
            return httpx.Response(exc.status, json={"code": exc.code, "detail": exc.message})
        return httpx.Response(200, json=answer.model_dump(mode="json"))

    async def stop(self) -> None:
        if self.service is not None:  # first: it leaves the control plane while that still answers
            await self.service.stop()
        elif self.agent is not None:
            await self.agent.close()
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                await replica.stop()
        self.replicas.clear()
        if self._tmp is not None:
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)

    async def __aenter__(self) -> ApiStack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

"""A running node: the agent, its HTTP API, and its link to the control plane (registration, heartbeats).

``capsa node`` runs one on its own host and reaches the control plane over HTTP (:class:`HttpControlLink`:
a one-time enrolment token on the first start, then the node credential kept in the state directory);
``capsa serve`` runs the same :class:`NodeService` in-process beside the control plane with a link that calls
the control plane's functions directly. Either way the control plane reaches the node only through the node
API, authenticated by a fresh random token the node hands over when it registers.

Stopping (:meth:`NodeService.stop`, what SIGTERM and SIGINT lead to) tells the control plane first, so the
sessions here are paused at their latest snapshot or failed at once, then destroys every VM, namespace and
tap and unmounts the storage pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import uvicorn

from capsa.common.connection_wire import ConnectionTokenOut, ConnectionTokenRequest
from capsa.common.errors import CapsaError
from capsa.common.node_wire import (
    Capacity,
    HeartbeatOut,
    NodeEnrol,
    NodeEnrolled,
    NodeHeartbeat,
    NodeRegister,
)
from capsa.common.service import QuietServer, bind_tcp, wait_started
from capsa.node.api.app import create_node_app
from capsa.node.assembly import NodeParts

__all__ = ["HEARTBEAT_INTERVAL", "LEAVE_TIMEOUT", "ControlLink", "ControlLinkError", "HttpControlLink",
           "NodeIdentity", "NodeService"]

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 5.0
LEAVE_TIMEOUT = 30.0
"""How long a stopping node waits for the control plane to take its sessions (``leave``) before it stops its
VMs anyway (deploy/systemd's TimeoutStopSec and Kubernetes' grace period leave room for it)."""
IDENTITY_FILE = "node-identity.json"


class ControlLinkError(CapsaError):
    code = "control_unreachable"
    status = 503


class ControlLink(Protocol):
    """How a node talks to the control plane."""

    async def register(self, req: NodeRegister) -> str:
        """(Re-)register; returns the node's id."""
        ...

    async def heartbeat(self, node_id: str, req: NodeHeartbeat) -> HeartbeatOut: ...

    async def leave(self, node_id: str) -> None:
        """The node is stopping: it takes no new sessions and its sessions lose their sandboxes now."""
        ...

    async def connection_token(self, node_id: str, session_id: str, connection_id: str) -> ConnectionTokenOut:
        """A current access token of a connection the session (on this node) binds; the control plane
        refreshes it when due. Raises a CapsaError coded ``connection_revoked`` once it is revoked."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class NodeIdentity:
    """What an enrolled node keeps (0600, in its state directory) to authenticate to the control plane."""

    id: str
    credential: str
    control_url: str

    @classmethod
    def load(cls, path: Path) -> NodeIdentity | None:
        try:
            raw = json.loads(path.read_text())
            return cls(id=str(raw["id"]), credential=str(raw["credential"]),
                       control_url=str(raw["control_url"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ControlLinkError(f"unreadable node identity {path}: {exc}", code="node_identity_invalid",
                                   status=500) from exc

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"id": self.id, "credential": self.credential, "control_url": self.control_url}, f)
        os.replace(tmp, path)


class HttpControlLink:
    """The control plane over HTTP: enrol once with a one-time token, then the stored node credential."""

    def __init__(self, control_url: str, state_dir: Path, *, enrol_token: str | None,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 30.0) -> None:
        self.control_url = control_url.rstrip("/")
        self._identity_path = state_dir / IDENTITY_FILE
        self._enrol_token = enrol_token
        self._identity = NodeIdentity.load(self._identity_path)
        if self._identity is not None and self._identity.control_url != self.control_url:
            log.warning("node identity was enrolled with %s, now using %s", self._identity.control_url,
                        self.control_url)
        if self._identity is None and not enrol_token:
            raise ControlLinkError("this node is not enrolled yet: pass --enrol-token (from `capsa nodes "
                                   "token`)", code="enrol_token_required", status=400)
        self._client = httpx.AsyncClient(base_url=self.control_url + "/v1", transport=transport,
                                         timeout=httpx.Timeout(timeout, connect=5.0))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, path: str, token: str, body: dict[str, object] | None) -> httpx.Response:
        try:
            response = await self._client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as exc:
            raise ControlLinkError(f"control plane {self.control_url} unreachable: {exc}") from exc
        if not response.is_success:
            try:
                problem = response.json()
                code, detail = str(problem.get("code", "control_error")), str(problem.get("detail", ""))
            except ValueError:
                code, detail = "control_error", response.text[:200]
            raise ControlLinkError(f"control plane refused {path}: {detail or response.status_code}",
                                   code=code, status=response.status_code)
        return response

    async def register(self, req: NodeRegister) -> str:
        if self._identity is None:
            assert self._enrol_token is not None
            enrol = NodeEnrol(**req.model_dump(), name=None)
            response = await self._post("/nodes/enrol", self._enrol_token, enrol.model_dump(mode="json"))
            enrolled = NodeEnrolled.model_validate(response.json())
            self._identity = NodeIdentity(enrolled.id, enrolled.credential, self.control_url)
            await asyncio.to_thread(self._identity.save, self._identity_path)
            self._enrol_token = None
            return enrolled.id
        await self._post(f"/nodes/{self._identity.id}/register", self._identity.credential,
                         req.model_dump(mode="json"))
        return self._identity.id

    async def heartbeat(self, node_id: str, req: NodeHeartbeat) -> HeartbeatOut:
        assert self._identity is not None
        response = await self._post(f"/nodes/{node_id}/heartbeat", self._identity.credential,
                                    req.model_dump(mode="json"))
        return HeartbeatOut.model_validate(response.json())

    async def leave(self, node_id: str) -> None:
        assert self._identity is not None
        await self._post(f"/nodes/{node_id}/leave", self._identity.credential, None)

    async def connection_token(self, node_id: str, session_id: str, connection_id: str) -> ConnectionTokenOut:
        assert self._identity is not None
        body = ConnectionTokenRequest(session_id=session_id).model_dump()
        response = await self._post(f"/nodes/{node_id}/connections/{connection_id}/token",
                                    self._identity.credential, body)
        return ConnectionTokenOut.model_validate(response.json())



class NodeService:
    """One node's agent served over HTTP and kept registered with the control plane."""

    def __init__(self, parts: NodeParts, link: ControlLink, *, listen: str | None = None,
                 uds: Path | None = None, advertise_url: str | None = None,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 on_registered: Callable[[str], Awaitable[None] | None] | None = None) -> None:
        if (listen is None) == (uds is None):
            raise ValueError("give exactly one of listen (HOST:PORT) and uds")
        self.parts = parts
        self.link = link
        self.api_token = secrets.token_urlsafe(32)
        self._heartbeat_interval = heartbeat_interval
        self._on_registered = on_registered
        self._uds = uds
        self._bind: tuple[str, int] | None = None
        self.app = create_node_app(parts.agent, self.api_token)
        """The node API (``capsa serve``'s control plane also calls it in-process)."""
        if uds is not None:
            config = uvicorn.Config(self.app, uds=str(uds), log_level="warning", lifespan="off",
                                    log_config=None)
            self._url = advertise_url or f"unix://{uds}"
        else:
            assert listen is not None
            host, _, port = listen.rpartition(":")
            self._bind = (host.strip("[]"), int(port))
            config = uvicorn.Config(self.app, host=self._bind[0], port=self._bind[1], log_level="warning",
                                    lifespan="off", log_config=None)
            self._url = advertise_url or f"http://{listen}"
        self._server = QuietServer(config)
        self._server_task: asyncio.Task[None] | None = None
        self._beats: asyncio.Task[None] | None = None
        self.node_id: str | None = None

    @property
    def url(self) -> str:
        """The URL the control plane reaches this node's API at."""
        if self._uds is None and self._server.started and self._url.endswith(":0"):
            port = self._server.servers[0].sockets[0].getsockname()[1]
            return self._url.rsplit(":", 1)[0] + f":{port}"
        return self._url

    def _registration(self) -> NodeRegister:
        agent = self.parts.agent
        return NodeRegister(url=self.url, api_token=self.api_token,
                            capacity=Capacity(**agent.capacity.as_dict()),
                            templates=agent.templates, egress=agent.egress is not None,
                            store=agent.store)

    def _heartbeat_body(self) -> NodeHeartbeat:
        agent = self.parts.agent
        return NodeHeartbeat(capacity=Capacity(**agent.capacity.as_dict()), used=agent.used(),
                             failed_sandboxes=agent.failed_sandboxes(),
                             sandboxes=[r.id for r in agent.list()],
                             templates=agent.templates)

    async def start(self) -> str:
        """Serve the node API, wait until the agent is ready (its base template in place, so a create is
        a restore, not a cold boot), register, start heartbeating; returns the node id.

        The control plane places sessions (and its ``/v1/ready`` counts nodes) only once a node has
        registered, so registering after the agent is ready is how the node reports readiness."""
        if self._uds is not None:
            self._uds.unlink(missing_ok=True)
        # bind_tcp's listener turns Nagle off for every connection (uvicorn's own does not).
        sockets = None if self._bind is None else [bind_tcp(*self._bind)]
        self._server_task = asyncio.create_task(self._server.serve(sockets=sockets), name="capsa-node-api")
        await wait_started(self._server, self._server_task, name="node API server")
        if self._uds is not None:
            self._uds.chmod(0o600)
        await self.parts.agent.wait_ready()
        self.node_id = await self.link.register(self._registration())
        self.parts.agent.node_id = self.node_id
        if self.parts.agent.egress is not None:
            node_id, link = self.node_id, self.link

            async def fetch(session_id: str, connection_id: str) -> ConnectionTokenOut:
                return await link.connection_token(node_id, session_id, connection_id)

            self.parts.agent.egress.tokens.fetch = fetch
        self._beats = asyncio.create_task(self._heartbeats(), name="capsa-node-heartbeat")
        if self._on_registered is not None:
            done = self._on_registered(self.node_id)
            if done is not None:
                await done
        return self.node_id

    async def beat(self) -> HeartbeatOut:
        """One heartbeat (what the loop :meth:`start` begins does every ``heartbeat_interval``): report to
        the control plane, then destroy the sandboxes no live session owns; returns the control plane's
        answer. Raises ControlLinkError as the link does."""
        answer = await self.link.heartbeat(self.node_id or "", self._heartbeat_body())
        for sandbox_id in answer.destroy_sandboxes:
            log.warning("destroying sandbox %s: no live session owns it", sandbox_id)
            await self.parts.agent.destroy(sandbox_id)
        return answer

    async def _heartbeats(self) -> None:
        registered = True
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            try:
                if not registered:  # the control plane forgot us (e.g. its database was reset) or was down
                    await self.link.register(self._registration())
                    registered = True
                await self.beat()
            except ControlLinkError as exc:
                if exc.status == 404:
                    registered = False
                log.warning("heartbeat failed: %s", exc)
            except Exception:
                log.exception("heartbeat failed")

    async def wait(self) -> None:
        """Until the node API server stops by itself (it normally runs until :meth:`stop`)."""
        assert self._server_task is not None
        await asyncio.shield(self._server_task)

    async def stop(self) -> None:
        """Leave the control plane, stop serving, destroy every sandbox, unmount storage. Idempotent."""
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
            self._beats = None
        if self.node_id is not None:
            try:
                # While the API still answers: the control plane destroys sandboxes through it.
                await asyncio.wait_for(self.link.leave(self.node_id), timeout=LEAVE_TIMEOUT)
            except Exception as exc:
                log.warning("could not tell the control plane that node %s is stopping: %s", self.node_id,
                            exc)
        if self._server_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._server_task
            self._server_task = None
        try:
            await self.parts.close()
        finally:
            if self._uds is not None:
                self._uds.unlink(missing_ok=True)
            await self.link.aclose()

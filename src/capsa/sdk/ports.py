"""``session.ports``: reach TCP ports inside the sandbox (HTTP, WebSocket, any TCP through a tunnel).

The API proxies ``/v1/sessions/{id}/ports/{port}/{path}`` to ``127.0.0.1:{port}`` inside the sandbox over
the guest channel, so the sandbox needs no network. :meth:`AsyncPorts.url` makes a URL carrying a fresh
access token (for a browser tab, or a tool that cannot send the API key); :meth:`AsyncPorts.forward`
listens on a local TCP port and carries each connection through the API's raw tunnel
(``/v1/sessions/{id}/tunnels/{port}``), as ``capsa port-forward`` does.

Tunnels connect to the API's own address with a socket of their own: a client built with a custom
``transport`` (an in-process app) can make URLs and tokens but not tunnels.
"""

from __future__ import annotations

import asyncio
import contextlib

from capsa.common.errors import CapsaError
from capsa.common.port_tunnel import PortTunnel, open_tunnel
from capsa.sdk.api_socket import upgrade
from capsa.sdk.models import PortToken, PortTokenInfo
from capsa.sdk.paths import seg
from capsa.sdk.resource import AsyncClosing, SessionResource

__all__ = ["AsyncPortForward", "AsyncPorts"]


def _check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer between 1 and 65535, not {port!r}")
    return port


class AsyncPorts(SessionResource):
    """The ports of one session."""

    def _path(self, port: int) -> str:
        return f"{self._base}/ports/{_check_port(port)}"

    def get_host(self, port: int) -> str:
        """The base URL of ``port`` through the API (``…/v1/sessions/{id}/ports/{port}/``). Requests to it
        need the API key, or a token from :meth:`create_token` (``?token=`` or ``X-Capsa-Port-Token``)."""
        return f"{self._client.config.api_url}/v1{self._path(port)}/"

    async def create_token(self, port: int, *, ttl_seconds: int | None = None) -> PortToken:
        """A new access token for ``port``: it expires after ``ttl_seconds`` (None: the API's default, a
        day; at most its maximum, a week), can be revoked, and dies with the session."""
        body = {"ttl_seconds": ttl_seconds} if ttl_seconds is not None else None
        return await self._call(PortToken, "POST", f"{self._path(port)}/tokens", json=body)

    async def list_tokens(self) -> list[PortTokenInfo]:
        """The session's port tokens that still work, every port (those :meth:`AsyncSession.browser` made
        included); never the tokens themselves."""
        return await self._list(PortTokenInfo, f"{self._base}/port-tokens")

    async def revoke_token(self, port: int | None, token_id: str) -> None:
        """Revoke a token (``port``: the port it opens, or None for any of the session's tokens)."""
        where = f"{self._base}/port-" if port is None else f"{self._path(port)}/"
        await self._client.request("DELETE", f"{where}tokens/{seg(token_id)}")

    async def url(self, port: int, path: str = "/", *, ttl_seconds: int | None = None) -> str:
        """A URL of ``path`` on ``port`` that works without the API key (it carries a fresh token): on the
        port's own host when the API serves ports on a domain of their own, else its path route."""
        token = await self.create_token(port, ttl_seconds=ttl_seconds)
        base, _, query = token.url.partition("?")
        return f"{base.rstrip('/')}/{path.lstrip('/')}?{query}"

    async def open_tunnel(self, port: int) -> PortTunnel:
        """A raw TCP connection to ``port`` inside the sandbox, through the API (``read``/``write``/``end``/
        ``aclose``). Raises the API's error (``port_unreachable``, ``not_found`` ...) if it cannot open."""
        path = f"{self._base}/tunnels/{_check_port(port)}"
        return await upgrade(self._client.config, path, "port tunnel", open_tunnel)

    async def forward(self, port: int, local_port: int = 0, *, host: str = "127.0.0.1") -> AsyncPortForward:
        """Listen on ``host:local_port`` (0: any free port) and carry each connection to ``port`` inside
        the sandbox. Close the returned forward to stop listening."""
        forward = AsyncPortForward(self, _check_port(port))
        await forward._start(host, local_port)
        return forward


class AsyncPortForward(AsyncClosing):
    """A local TCP listener whose connections go to a port in the sandbox (:meth:`AsyncPorts.forward`)."""

    def __init__(self, ports: AsyncPorts, port: int) -> None:
        self._ports = ports
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0
        """Connections accepted so far."""

    async def _start(self, host: str, local_port: int) -> None:
        self._server = await asyncio.start_server(self._accept, host, local_port)

    @property
    def local_port(self) -> int:
        """The local port listening (useful after ``local_port=0``)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def local_address(self) -> str:
        assert self._server is not None
        host = self._server.sockets[0].getsockname()[0]
        return f"{host}:{self.local_port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            try:
                tunnel = await self._ports.open_tunnel(self.port)
            except Exception:
                return  # the local client sees its connection closed: nothing to speak to
            with contextlib.suppress(OSError, ConnectionError, CapsaError):
                await _relay(reader, writer, tunnel)
        finally:
            writer.close()
            with contextlib.suppress(OSError, RuntimeError):
                await writer.wait_closed()
            self._tasks.discard(task)

    async def close(self) -> None:
        """Stop listening and drop the connections in flight."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()



async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tunnel: PortTunnel) -> None:
    async def up() -> None:
        while data := await reader.read(256 * 1024):
            await tunnel.write(data)
        await tunnel.end()

    async def down() -> None:
        while data := await tunnel.read():
            writer.write(data)
            await writer.drain()

    uploading = asyncio.create_task(up())
    try:
        await down()
    finally:
        uploading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await uploading
        await tunnel.aclose()

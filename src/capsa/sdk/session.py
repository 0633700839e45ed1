"""``AsyncSession``: one sandboxed session, the SDK's main object (``Session`` is its blocking twin)."""

# The API's `timeout` parameters are the remote deadlines the contract defines, not asyncio timeouts.
# ruff: noqa: ASYNC109

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, overload

import httpx

from capsa.sdk.browser import AsyncComputer, BrowserInfo
from capsa.sdk.client import AsyncClient
from capsa.sdk.commands import AsyncCommands
from capsa.sdk.egress import AsyncEgress, AuditEvent, PolicyInfo
from capsa.sdk.files import AsyncFiles
from capsa.sdk.models import SessionInfo, parse
from capsa.sdk.paths import seg
from capsa.sdk.ports import AsyncPorts
from capsa.sdk.resource import AsyncClosing
from capsa.sdk.snapshots import AsyncSnapshots
from capsa.sdk.terminals import AsyncPty

__all__ = ["AsyncSession"]


class _Resume:
    """``AsyncSession.resume(id, ...)`` attaches to a paused session and resumes it; ``s.resume()`` resumes
    the session ``s`` in place. One name for both, as the API documents it."""

    @overload
    def __get__(self, obj: None,
                owner: type[AsyncSession]) -> Callable[..., Coroutine[Any, Any, AsyncSession]]: ...

    @overload
    def __get__(self, obj: AsyncSession,
                owner: type[AsyncSession]) -> Callable[[], Coroutine[Any, Any, SessionInfo]]: ...

    def __get__(self, obj: AsyncSession | None,
                owner: type[AsyncSession]) -> Callable[..., Coroutine[Any, Any, Any]]:
        if obj is None:
            return owner._resume_by_id
        return obj._resume


class AsyncSession(AsyncClosing):
    """A capsa session. Create one with :meth:`create`, or attach to an existing one with :meth:`connect`.

    Used as ``async with``, the session is closed (its sandbox destroyed) when the block ends.
    """

    def __init__(self, info: SessionInfo, client: AsyncClient, *, owns_client: bool = False) -> None:
        self.info = info
        self._client = client
        self._owns_client = owns_client
        self.commands = AsyncCommands(client, info.id)
        self.files = AsyncFiles(client, info.id)
        self.snapshots = AsyncSnapshots(self)
        self.egress = AsyncEgress(client, info.id)
        self.ports = AsyncPorts(client, info.id)
        self.pty = AsyncPty(client, info.id)
        self.computer = AsyncComputer(client, info.id)

    @staticmethod
    def _client_for(client: AsyncClient | None, api_url: str | None, api_key: str | None,
                    transport: httpx.AsyncBaseTransport | None) -> tuple[AsyncClient, bool]:
        if client is not None:
            return client, False
        return AsyncClient(api_url, api_key, transport=transport), True

    @classmethod
    async def _attach(cls, conn_owned: tuple[AsyncClient, bool],
                      load: Callable[[AsyncClient], Awaitable[SessionInfo]]) -> AsyncSession:
        """An object for the session ``load`` answers with; a connection opened for it is closed again if
        ``load`` fails."""
        conn, owned = conn_owned
        try:
            info = await load(conn)
        except BaseException:
            if owned:
                await conn.aclose()
            raise
        return cls(info, conn, owns_client=owned)

    @classmethod
    async def create(cls, template: str = "base", *, timeout: int | None = None,
                     idle_timeout: int | None = None, env: Mapping[str, str] | None = None,
                     metadata: Mapping[str, str] | None = None, memory_mib: int | None = None,
                     vcpus: int | None = None, on_timeout: Literal["pause", "close"] | None = None,
                     rolling_snapshots: Mapping[str, Any] | None = None, keep_snapshots: bool | None = None,
                     policy: Mapping[str, Any] | None = None, expose: Sequence[int] | None = None,
                     api_url: str | None = None, api_key: str | None = None,
                     client: AsyncClient | None = None,
                     transport: httpx.AsyncBaseTransport | None = None) -> AsyncSession:
        """Start a new session from ``template``. ``timeout`` is its hard lifetime in seconds.

        ``on_timeout="pause"`` keeps a snapshot when the lifetime or idle timeout passes (resume it later);
        ``rolling_snapshots={"interval_s": 300, "after_command": True, "keep": 3}`` snapshots the session
        in the background so it survives the loss of its sandbox; ``keep_snapshots`` keeps them after close.

        ``policy`` is an egress policy (``{"domains": [...], "secrets": [...]}``); without one the session
        has no network at all. Secrets it binds are referred to by name and reach the sandbox only as
        placeholders (see :class:`capsa.sdk.egress.AsyncSecrets`).

        ``expose`` lists the only ports that :attr:`ports` (the API's port proxy) may reach.
        """
        def start(conn: AsyncClient) -> Awaitable[SessionInfo]:
            return conn.create_session(template=template, timeout=timeout, idle_timeout=idle_timeout, env=env,
                                       metadata=metadata, memory_mib=memory_mib, vcpus=vcpus,
                                       on_timeout=on_timeout, rolling_snapshots=rolling_snapshots,
                                       keep_snapshots=keep_snapshots, policy=policy, expose=expose)

        return await cls._attach(cls._client_for(client, api_url, api_key, transport), start)

    @classmethod
    async def connect(cls, session_id: str, *, api_url: str | None = None, api_key: str | None = None,
                      client: AsyncClient | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> AsyncSession:
        """Attach to an existing session (raises ``NotFound`` if this key cannot see it)."""
        return await cls._attach(cls._client_for(client, api_url, api_key, transport),
                                 lambda conn: conn.get_session(session_id))

    @classmethod
    async def list(cls, *, state: str | None = None, metadata: Mapping[str, str] | None = None,
                   limit: int | None = None, api_url: str | None = None, api_key: str | None = None,
                   client: AsyncClient | None = None,
                   transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[SessionInfo]:
        """This tenant's sessions, newest first, optionally filtered by state and metadata."""
        conn, owned = cls._client_for(client, api_url, api_key, transport)
        try:
            return await conn.list_sessions(state=state, metadata=metadata, limit=limit)
        finally:
            if owned:
                await conn.aclose()

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> str:
        """The state as last seen by this object; call :meth:`refresh` to ask the server."""
        return self.info.state

    @property
    def client(self) -> AsyncClient:
        return self._client

    async def audit(self, *, decision: str | None = None,
                    limit: int | None = None) -> builtins.list[AuditEvent]:
        """The session's egress audit trail (requests, DNS queries, dropped packets), oldest first."""
        return await self.egress.audit(decision=decision, limit=limit)

    async def set_policy(self, policy: Mapping[str, Any]) -> PolicyInfo:
        """Replace the running session's egress policy (applies without a restart)."""
        return await self.egress.set_policy(policy)

    async def browser_info(self, *, interactive: bool = False) -> BrowserInfo:
        """Where to drive the session's browser: ``cdp_url`` for ``connect_over_cdp`` (a new port token);
        on a desktop also ``live_url``, the noVNC live view: view-only, or taking input with
        ``interactive=True``."""
        params = {"interactive": "true"} if interactive else None
        return parse(BrowserInfo, await self._client.json("GET", f"/sessions/{seg(self.id)}/browser",
                                                          params=params))

    async def browser(self, *, interactive: bool = False) -> BrowserInfo:
        """Same as :meth:`browser_info`."""
        return await self.browser_info(interactive=interactive)

    def get_host(self, port: int) -> str:
        """The base URL of ``port`` inside the sandbox through the API (needs the key or a port token;
        ``await s.ports.url(port)`` makes a URL with a fresh token)."""
        return self.ports.get_host(port)

    async def refresh(self) -> SessionInfo:
        self.info = await self._client.get_session(self.id)
        return self.info

    async def set_timeout(self, timeout: int) -> SessionInfo:
        """Make the session expire ``timeout`` seconds from now."""
        self.info = await self._client.set_session_timeout(self.id, timeout)
        return self.info

    async def pause(self) -> SessionInfo:
        """Snapshot the session and stop its sandbox; :meth:`resume` continues exactly where it was."""
        self.info = await self._client.pause_session(self.id)
        return self.info

    resume = _Resume()

    async def _resume(self) -> SessionInfo:
        self.info = await self._client.resume_session(self.id)
        return self.info

    @classmethod
    async def _resume_by_id(cls, session_id: str, *, api_url: str | None = None, api_key: str | None = None,
                            client: AsyncClient | None = None,
                            transport: httpx.AsyncBaseTransport | None = None) -> AsyncSession:
        return await cls._attach(cls._client_for(client, api_url, api_key, transport),
                                 lambda conn: conn.resume_session(session_id))

    async def branch(self, n: int = 1) -> builtins.list[AsyncSession]:
        """``n`` new, independent sessions starting from this session's current state (metadata copied,
        plus ``branched_from``). They share this object's connection."""
        infos = await self._client.branch_session(self.id, n)
        return [AsyncSession(info, self._client) for info in infos]

    async def close(self) -> SessionInfo:
        """Close the session (its sandbox is destroyed) and release this object's connection."""
        if self._client.is_closed and self.info.state == "closed":
            return self.info  # already closed through this object
        try:
            self.info = await self._client.close_session(self.id)
        finally:
            await self.disconnect()
        return self.info

    async def disconnect(self) -> None:
        """Release the local connection only; the session keeps running on the server."""
        if self._owns_client:
            self._owns_client = False
            await self._client.aclose()


    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, state={self.state!r}, template={self.info.template!r})"


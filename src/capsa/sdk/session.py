"""``AsyncSession``: one sandboxed session, the SDK's main object (``Session`` is its blocking twin)."""

# The API's `timeout` parameters are the remote deadlines the contract defines, not asyncio timeouts.
# ruff: noqa: ASYNC109

from __future__ import annotations

import builtins
from collections.abc import Mapping
from types import TracebackType

import httpx

from capsa.sdk.client import AsyncClient
from capsa.sdk.commands import AsyncCommands
from capsa.sdk.files import AsyncFiles
from capsa.sdk.models import SessionInfo

__all__ = ["AsyncSession"]


class AsyncSession:
    """A capsa session. Create one with :meth:`create`, or attach to an existing one with :meth:`connect`.

    Used as ``async with``, the session is closed (its sandbox destroyed) when the block ends.
    """

    def __init__(self, info: SessionInfo, client: AsyncClient, *, owns_client: bool = False) -> None:
        self.info = info
        self._client = client
        self._owns_client = owns_client
        self.commands = AsyncCommands(client, info.id)
        self.files = AsyncFiles(client, info.id)

    @staticmethod
    def _client_for(client: AsyncClient | None, api_url: str | None, api_key: str | None,
                    transport: httpx.AsyncBaseTransport | None) -> tuple[AsyncClient, bool]:
        if client is not None:
            return client, False
        return AsyncClient(api_url, api_key, transport=transport), True

    @classmethod
    async def create(cls, template: str = "base", *, timeout: int | None = None,
                     idle_timeout: int | None = None, env: Mapping[str, str] | None = None,
                     metadata: Mapping[str, str] | None = None, memory_mib: int | None = None,
                     vcpus: int | None = None, api_url: str | None = None, api_key: str | None = None,
                     client: AsyncClient | None = None,
                     transport: httpx.AsyncBaseTransport | None = None) -> AsyncSession:
        """Start a new session from ``template``. ``timeout`` is its hard lifetime in seconds."""
        conn, owned = cls._client_for(client, api_url, api_key, transport)
        try:
            info = await conn.create_session(template=template, timeout=timeout, idle_timeout=idle_timeout,
                                             env=env, metadata=metadata, memory_mib=memory_mib, vcpus=vcpus)
        except BaseException:
            if owned:
                await conn.aclose()
            raise
        return cls(info, conn, owns_client=owned)

    @classmethod
    async def connect(cls, session_id: str, *, api_url: str | None = None, api_key: str | None = None,
                      client: AsyncClient | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> AsyncSession:
        """Attach to an existing session (raises ``NotFound`` if this key cannot see it)."""
        conn, owned = cls._client_for(client, api_url, api_key, transport)
        try:
            info = await conn.get_session(session_id)
        except BaseException:
            if owned:
                await conn.aclose()
            raise
        return cls(info, conn, owns_client=owned)

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

    async def refresh(self) -> SessionInfo:
        self.info = await self._client.get_session(self.id)
        return self.info

    async def set_timeout(self, timeout: int) -> SessionInfo:
        """Make the session expire ``timeout`` seconds from now."""
        self.info = await self._client.set_session_timeout(self.id, timeout)
        return self.info

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

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, state={self.state!r}, template={self.info.template!r})"


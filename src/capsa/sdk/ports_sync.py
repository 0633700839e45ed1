"""Blocking twins of :mod:`capsa.sdk.ports` (``Session.ports``), run through the SDK's portal."""

from __future__ import annotations

from capsa.sdk.models import PortToken, PortTokenInfo
from capsa.sdk.portal import Blocking, Closing
from capsa.sdk.ports import AsyncPortForward, AsyncPorts

__all__ = ["PortForward", "Ports"]


class Ports(Blocking[AsyncPorts]):
    """See :class:`capsa.sdk.ports.AsyncPorts` (raw tunnels are async only: use :meth:`forward`)."""

    def get_host(self, port: int) -> str:
        return self._inner.get_host(port)

    def create_token(self, port: int, *, ttl_seconds: int | None = None) -> PortToken:
        return self._portal.call(self._inner.create_token(port, ttl_seconds=ttl_seconds))

    def list_tokens(self) -> list[PortTokenInfo]:
        return self._portal.call(self._inner.list_tokens())

    def revoke_token(self, port: int | None, token_id: str) -> None:
        self._portal.call(self._inner.revoke_token(port, token_id))

    def url(self, port: int, path: str = "/", *, ttl_seconds: int | None = None) -> str:
        return self._portal.call(self._inner.url(port, path, ttl_seconds=ttl_seconds))

    def forward(self, port: int, local_port: int = 0, *, host: str = "127.0.0.1") -> PortForward:
        return PortForward(self._portal.call(self._inner.forward(port, local_port, host=host)), self._portal)


class PortForward(Blocking[AsyncPortForward], Closing):
    """See :class:`capsa.sdk.ports.AsyncPortForward`; connections are served on the SDK's loop thread."""

    @property
    def port(self) -> int:
        return self._inner.port

    @property
    def connections(self) -> int:
        return self._inner.connections

    @property
    def local_port(self) -> int:
        return self._inner.local_port

    @property
    def local_address(self) -> str:
        return self._inner.local_address

    def close(self) -> None:
        self._portal.call(self._inner.close())

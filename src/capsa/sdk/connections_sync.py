"""Blocking twins of :mod:`capsa.sdk.connections` (``Client.connections``,
``Client.connection_providers``)."""

from __future__ import annotations

import builtins
from datetime import datetime

from capsa.sdk.connections import (
    AsyncConnectionProviders,
    AsyncConnections,
    ConnectionInfo,
    Login,
    LoginPoll,
    ProviderInfo,
    Revocation,
)
from capsa.sdk.portal import Blocking

__all__ = ["ConnectionProviders", "Connections"]


class ConnectionProviders(Blocking[AsyncConnectionProviders]):
    def create(self, name: str, *, client_id: str, client_secret: str | None = None,
               issuer: str | None = None, authorization_endpoint: str | None = None,
               token_endpoint: str | None = None, revocation_endpoint: str | None = None,
               device_authorization_endpoint: str | None = None,
               scopes: builtins.list[str] | None = None) -> ProviderInfo:
        return self._portal.call(self._inner.create(
            name, client_id=client_id, client_secret=client_secret, issuer=issuer,
            authorization_endpoint=authorization_endpoint, token_endpoint=token_endpoint,
            revocation_endpoint=revocation_endpoint,
            device_authorization_endpoint=device_authorization_endpoint, scopes=scopes))

    def list(self) -> builtins.list[ProviderInfo]:
        return self._portal.call(self._inner.list())

    def delete(self, provider: str) -> None:
        self._portal.call(self._inner.delete(provider))


class Connections(Blocking[AsyncConnections]):
    def create(self, name: str, provider: str, *, scopes: builtins.list[str] | None = None) -> ConnectionInfo:
        return self._portal.call(self._inner.create(name, provider, scopes=scopes))

    def list(self) -> builtins.list[ConnectionInfo]:
        return self._portal.call(self._inner.list())

    def get(self, connection: str) -> ConnectionInfo:
        return self._portal.call(self._inner.get(connection))

    def login(self, connection: str, *, device: bool = False) -> Login:
        return self._portal.call(self._inner.login(connection, device=device))

    def poll(self, connection: str, login_id: str) -> LoginPoll:
        return self._portal.call(self._inner.poll(connection, login_id))

    def wait_for_device(self, connection: str, login: Login, *,
                        deadline: float | None = None) -> ConnectionInfo:
        return self._portal.call(self._inner.wait_for_device(connection, login, deadline=deadline))

    def wait_until_active(self, connection: str, *, after: datetime | None = None,
                          deadline: float = 600.0, interval: float = 1.0) -> ConnectionInfo:
        return self._portal.call(self._inner.wait_until_active(connection, after=after, deadline=deadline,
                                                               interval=interval))

    def revoke(self, connection: str) -> Revocation:
        return self._portal.call(self._inner.revoke(connection))

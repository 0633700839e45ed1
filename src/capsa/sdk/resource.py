"""The base of the SDK's resource objects (``client.secrets``, ``session.files`` ...): the client they call
through, and the request-then-parse step their calls share. The client raises the API's errors; a
malformed answer raises :class:`~capsa.sdk.errors.UnexpectedResponse`. Also :class:`AsyncClosing`, the
``async with`` of the async objects that hold something open (a terminal, a port forward, a session)."""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Self, TypeVar

from pydantic import BaseModel

from capsa.sdk.models import parse, parse_items
from capsa.sdk.paths import seg

if TYPE_CHECKING:
    from capsa.sdk.client import AsyncClient

__all__ = ["AsyncClosing", "Resource", "SessionResource"]

M = TypeVar("M", bound=BaseModel)


class Resource:
    """API calls through one client, answers parsed into the SDK's models."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def _call(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        """``method path`` (``kwargs`` as :meth:`AsyncClient.request` takes them), its answer as ``model``."""
        return parse(model, await self._client.json(method, path, **kwargs))

    async def _list(self, model: type[M], path: str, **kwargs: Any) -> builtins.list[M]:
        """``GET path``: the ``items`` of the list answer, each as ``model``."""
        return parse_items(model, await self._client.json("GET", path, **kwargs))


class SessionResource(Resource):
    """API calls on one session, below :attr:`_base` (``/sessions/{id}``)."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        super().__init__(client)
        self._session_id = session_id

    @property
    def _base(self) -> str:
        return f"/sessions/{seg(self._session_id)}"


class AsyncClosing(ABC):
    """An async object that holds something open until :meth:`close`: ``async with obj:`` gives ``obj``
    and closes it when the block ends, however it ends."""

    @abstractmethod
    async def close(self) -> object:
        """Release what the object holds."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""The base of capsa's pure ASGI middlewares (the request guard, the node API's log context, the control
plane's audit and port-host routing): each acts on HTTP requests and WebSocket connections only."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ConnectionMiddleware"]


class ConnectionMiddleware(ABC):
    """Middleware for HTTP requests and WebSocket connections, which it passes to :meth:`handle`; other
    scopes (``lifespan``) go straight on to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request or connection (``scope["type"]`` is ``http`` or ``websocket``)."""

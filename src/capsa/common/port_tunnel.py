"""The port tunnel protocol: a raw TCP connection to a port inside a sandbox, carried in WebSocket messages.

Served by the node (``/node/v1/sandboxes/{id}/ports/{port}/tunnel``) and, for clients such as
``capsa port-forward``, by the control plane (``/v1/sessions/{id}/tunnels/{port}``):

1. the server opens the connection to the port, then sends one TEXT message: ``{"ok": true}``, or a
   problem (``{"status", "code", "detail"}``, e.g. 502 ``port_unreachable``) and closes;
2. then BINARY messages carry the connection's bytes both ways. An empty BINARY message from the client
   half-closes (the server inside the sandbox reads EOF); the server closes the WebSocket (code 1000) once
   the port closed its side and every byte was sent; the client closing it drops the connection.

:class:`PortTunnel` is the client end as a :class:`~capsa.common.websocket.ByteStream`, so an HTTP
client (h11) or a WebSocket client can run over it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from capsa.common.errors import CapsaError
from capsa.common.websocket import ByteStream, WebSocketClient, WebSocketRejected, receive_first_json, upgrade

__all__ = ["OK_MESSAGE", "PortTunnel", "open_tunnel", "problem_message"]

OK_MESSAGE = json.dumps({"ok": True})


def problem_message(status: int, code: str, detail: str) -> str:
    """The first (and last) TEXT message of a tunnel that could not be opened."""
    return json.dumps({"ok": False, "status": status, "code": code, "detail": detail})


def _refused(exc: WebSocketRejected) -> CapsaError:
    code, detail = _problem(exc.body)
    return CapsaError(detail or f"port tunnel refused with HTTP {exc.status}", code=code, status=exc.status)


def _problem(raw: bytes) -> tuple[str, str]:
    try:
        body: Any = json.loads(raw)
        return str(body.get("code", "tunnel_refused")), str(body.get("detail", ""))
    except (ValueError, AttributeError):
        return "tunnel_refused", raw[:200].decode(errors="replace")


class PortTunnel:
    """The client end of an open tunnel: ``read`` (b"" once the port closed), ``write``, ``end``, ``aclose``.
    """

    def __init__(self, ws: WebSocketClient) -> None:
        self._ws = ws
        self._eof = False

    async def read(self) -> bytes:
        while not self._eof:
            message = await self._ws.receive()
            if message is None:
                self._eof = True
                if self._ws.close_code not in (1000, None):
                    raise ConnectionError(f"port tunnel broke (WebSocket close {self._ws.close_code}: "
                                          f"{self._ws.close_reason})")
                break
            if isinstance(message, bytes) and message:
                return message
        return b""

    async def write(self, data: bytes) -> None:
        if data:
            await self._ws.send(data)

    async def end(self) -> None:
        await self._ws.send(b"")

    async def aclose(self) -> None:
        await self._ws.close()


async def open_tunnel(stream: ByteStream, host: str, target: str, *,
                      headers: Sequence[tuple[str, str]] = ()) -> PortTunnel:
    """Upgrade ``stream`` to a tunnel at ``target``; a refusal raises CapsaError with the server's code."""
    ws = await upgrade(stream, host, target, headers=headers, refused=_refused)
    bad = "the port tunnel sent a bad status"
    first, body = await receive_first_json(ws, bad=bad, code="tunnel_refused")
    if not isinstance(first, str):
        await ws.close()
        raise CapsaError("the port tunnel closed before saying whether it opened", code="tunnel_refused",
                         status=502)
    if not isinstance(body, dict):
        await ws.close()
        raise CapsaError(f"{bad}: not an object", code="tunnel_refused", status=502)
    if body.get("ok") is not True:
        await ws.close()
        status = body.get("status")
        raise CapsaError(str(body.get("detail", "port tunnel refused")),
                         code=str(body.get("code", "tunnel_refused")),
                         status=status if isinstance(status, int) and 400 <= status < 600 else 502)
    return PortTunnel(ws)

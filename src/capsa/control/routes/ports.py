"""``/v1/sessions/{id}/ports/{port}/…``: HTTP and WebSocket into a port of the sandbox; port tokens; tunnels.

- ``GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS /sessions/{id}/ports/{port}/{path}`` and a WebSocket upgrade on
  the same path reach ``127.0.0.1:{port}`` inside the sandbox (:mod:`capsa.control.ports.proxy`), over the
  guest channel: the sandbox needs no network device.
- ``POST /sessions/{id}/ports/{port}/tokens`` makes an access token for that port
  (:mod:`capsa.control.ports.access`; body ``{"ttl_seconds": N}``, optional), ``DELETE …/tokens/{token_id}``
  revokes it. These two paths of the app behind the port are therefore not reachable through the API's
  path route with those methods (they are on the port's own host).
- ``GET /sessions/{id}/port-tokens`` lists the session's tokens (every port, ``GET …/browser``'s too),
  ``DELETE /sessions/{id}/port-tokens/{token_id}`` revokes any of them.
- ``/sessions/{id}/tunnels/{port}`` (WebSocket) is the raw TCP tunnel (:mod:`capsa.common.port_tunnel`)
  that ``capsa port-forward`` uses. To the browser's CDP port it takes the API key only: CDP over a raw
  tunnel would pass by the download-directory rewrite of the proxied CDP WebSocket.

:data:`proxy_router` holds the proxy's routes alone: the app serves it on ports' own hosts
(:mod:`capsa.control.ports.hosts`).

Authentication: the API key (``Authorization: Bearer``) as everywhere, or a port token (``?token=`` or
``X-Capsa-Port-Token``). The proxy answers ``port_not_exposed`` (403) for ports outside the session's
``expose`` list and ``port_unreachable`` (502) when nothing listens on the port. Before a WebSocket is
accepted, failures answer the upgrade with the problem+json error and its HTTP status (401, 404, 403,
502 ...).
"""

from __future__ import annotations

import contextlib
from typing import Annotated

from fastapi import APIRouter, Body, Path, Request, Response, WebSocket
from starlette.websockets import WebSocketDisconnect

from capsa.common.errors import CapsaError
from capsa.common.port_tunnel import OK_MESSAGE, PortTunnel, problem_message
from capsa.control.browser.cdp import CDP_PORT, pin_downloads
from capsa.control.deps import PROBLEMS, Caller, Plane, problems
from capsa.control.errors import ApiError
from capsa.control.plane import ControlPlane
from capsa.control.ports.access import (
    PortAccess,
    authorize,
    create_token,
    keep_active,
    list_tokens,
    revoke_token,
)
from capsa.control.ports.proxy import proxy_http, proxy_websocket, relay_tunnel
from capsa.control.problems import refuse_websocket
from capsa.control.schemas import PortToken, PortTokenCreate, PortTokenList
from capsa.control.sessions import relay

__all__ = ["proxy_router", "router"]

router = APIRouter(prefix="/sessions/{session_id}", tags=["ports"], responses=PROBLEMS)
proxy_router = APIRouter(prefix="/sessions/{session_id}", tags=["ports"], responses=PROBLEMS)

Port = Annotated[int, Path(ge=1, le=65535, description="TCP port inside the sandbox")]
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
_PROXY_DOC = {
    "responses": {
        "502": {"description": "Nothing listens on the port (`port_unreachable`), or it does not answer "
                               "HTTP (`port_protocol_error`)",
                "content": {"application/problem+json": {}}},
        "403": {"description": "The session does not expose this port (`port_not_exposed`)",
                "content": {"application/problem+json": {}}},
    },
}


class RawCdpRefused(ApiError):
    code, status, title = "raw_tunnel_refused", 403, "Raw tunnel refused"


def _base_url(plane: ControlPlane, request: Request) -> str:
    return plane.settings.public_url or str(request.base_url)


@router.post("/ports/{port}/tokens", status_code=201, response_model=PortToken, responses=problems(403))
async def create_port_token(session_id: str, port: Port, request: Request, plane: Plane, caller: Caller,
                            body: Annotated[PortTokenCreate | None, Body()] = None) -> PortToken:
    """An access token for this port of this session: shown once, expires after ``ttl_seconds``
    (default a day), revocable, gone when the session ends."""
    return await create_token(plane, caller.tenant, session_id, port, _base_url(plane, request),
                              body.ttl_seconds if body is not None else None)


@router.delete("/ports/{port}/tokens/{token_id}", status_code=204, response_class=Response)
async def revoke_port_token(session_id: str, port: Port, token_id: str, plane: Plane,
                            caller: Caller) -> Response:
    await revoke_token(plane, caller.tenant, session_id, port, token_id)
    return Response(status_code=204)


@router.get("/port-tokens", response_model=PortTokenList, responses=problems(404))
async def list_port_tokens(session_id: str, plane: Plane, caller: Caller) -> PortTokenList:
    """The session's port tokens that still work, every port (``GET …/browser``'s included); never the
    tokens themselves."""
    return PortTokenList(items=await list_tokens(plane, caller.tenant, session_id))


@router.delete("/port-tokens/{token_id}", status_code=204, response_class=Response, responses=problems(404))
async def revoke_any_port_token(session_id: str, token_id: str, plane: Plane, caller: Caller) -> Response:
    """Revoke one of the session's port tokens, whatever port it opens."""
    await revoke_token(plane, caller.tenant, session_id, None, token_id)
    return Response(status_code=204)


async def _open(access: PortAccess, port: int) -> PortTunnel:
    return await relay.call(access.target, lambda node, sandbox: node.open_port(sandbox, port))


async def proxy(session_id: str, port: Port, path: str, request: Request, plane: Plane) -> Response:
    """The app listening on ``port`` in the sandbox answers (request and response bodies streamed)."""
    access = await authorize(plane, request, session_id, port)
    tunnel = await _open(access, port)
    return await proxy_http(request, access, port, path, tunnel)


for _router in (router, proxy_router):  # the API's path route, and ports' own hosts
    for _method in _METHODS:  # one operation per method, so each has its own stable operation id
        _router.add_api_route("/ports/{port}/{path:path}", proxy, methods=[_method], response_class=Response,
                              operation_id=f"proxy_port_{_method.lower()}", openapi_extra=_PROXY_DOC,
                              summary=f"{_method} to a port in the sandbox")


async def proxy_ws(websocket: WebSocket, session_id: str, port: Port, path: str) -> None:
    plane = websocket.app.state.plane
    assert isinstance(plane, ControlPlane)
    try:
        access = await authorize(plane, websocket, session_id, port)
        tunnel = await _open(access, port)
    except CapsaError as exc:
        await refuse_websocket(websocket, exc)
        return
    async with keep_active(plane, session_id):
        # The browser templates' CDP port: downloads stay in the session's download directory.
        await proxy_websocket(websocket, access, port, path, tunnel,
                              rewrite=pin_downloads if port == CDP_PORT else None)


for _router in (router, proxy_router):
    _router.add_api_websocket_route("/ports/{port}/{path:path}", proxy_ws)


@router.websocket("/tunnels/{port}")
async def tunnel(websocket: WebSocket, session_id: str, port: Port) -> None:
    """A raw TCP connection to the port (protocol: capsa.common.port_tunnel)."""
    plane = websocket.app.state.plane
    assert isinstance(plane, ControlPlane)
    try:
        access = await authorize(plane, websocket, session_id, port)
        if port == CDP_PORT and not access.used_api_key:
            raise RawCdpRefused(f"a raw tunnel to port {CDP_PORT} (CDP) takes the API key; with a port token "
                                f"use the CDP WebSocket of GET /v1/sessions/{session_id}/browser")
    except CapsaError as exc:
        await refuse_websocket(websocket, exc)
        return
    await websocket.accept()
    try:
        opened = await _open(access, port)
    except CapsaError as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await websocket.send_text(problem_message(exc.status, exc.code, exc.message))
            await websocket.close()
        return
    await websocket.send_text(OK_MESSAGE)
    async with keep_active(plane, session_id):
        await relay_tunnel(websocket, opened)


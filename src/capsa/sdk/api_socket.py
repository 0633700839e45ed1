"""Connections to the API on a socket of their own (port tunnels, terminals): :func:`upgrade` dials the
API's address, runs a WebSocket-style upgrade at a ``/v1`` path with the client's key, and turns failures
into the SDK's errors. A client built with a custom ``transport`` has no address to dial."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from capsa.common.errors import CapsaError
from capsa.common.websocket import SocketStream
from capsa.sdk.config import ClientConfig
from capsa.sdk.errors import CapsaConnectionError, error_from_problem

__all__ = ["Handshake", "api_error", "upgrade"]

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


class Handshake(Protocol[_T_co]):
    """Upgrade ``stream`` at ``target`` (``open_tunnel``, ``TerminalClient.connect``); a refusal raises
    CapsaError with the server's status and code."""

    def __call__(self, stream: SocketStream, host: str, target: str, *,
                 headers: Sequence[tuple[str, str]] = ()) -> Awaitable[_T_co]: ...


def api_error(exc: CapsaError) -> Exception:
    """The SDK error for a refusal the API answered an upgrade with."""
    return error_from_problem(exc.status, {"code": exc.code, "detail": exc.message})


async def upgrade(config: ClientConfig, path: str, what: str, handshake: Handshake[_T], *,
                  refused: Callable[[CapsaError], Exception] = api_error) -> _T:
    """Dial the API and upgrade ``/v1{path}`` with ``handshake``. A refusal raises ``refused(error)``;
    a socket that cannot connect, or fails during the handshake (``what`` names the connection in the
    message), raises :class:`CapsaConnectionError`."""
    url = urlsplit(config.api_url)
    tls = url.scheme == "https"
    target = f"{url.path.rstrip('/')}/v1{path}"
    headers = [("Authorization", f"Bearer {config.api_key}")] if config.api_key else []
    try:
        stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or (443 if tls else 80),
                                            tls=tls, timeout=config.timeout)
    except (OSError, TimeoutError) as exc:
        raise CapsaConnectionError(f"cannot reach capsa API at {config.api_url}: {exc}",
                                   url=config.api_url) from None
    try:
        return await handshake(stream, url.netloc, target, headers=headers)
    except CapsaError as exc:
        raise refused(exc) from None
    except (OSError, ConnectionError) as exc:
        raise CapsaConnectionError(f"the {what} to {config.api_url} failed: {exc}",
                                   url=config.api_url) from None

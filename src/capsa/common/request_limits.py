"""``CAPSA_REQUEST_*``: what one capsa HTTP API process (the control plane's, a node's) lets its callers hold.

Read by the control plane's app and the node API's app alike; :mod:`capsa.common.request_guard` enforces
them before any route runs.
"""

from __future__ import annotations

from typing import Annotated

from limits import RateLimitItem, parse
from pydantic import AfterValidator, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["COMMAND_BODY_BYTES", "RATE_LIMIT_OFF", "RequestLimits"]

RATE_LIMIT_OFF = "off"
COMMAND_BODY_BYTES = 6 * (16 << 20) + (1 << 20)
"""Largest body of a command request (``/v1/.../commands``, the node's ``/exec``): its stdin may be 16 MiB
of characters, which JSON may write as up to 6 bytes each (``\\u001b``), plus the rest of the request."""


def _rate(value: str) -> str:
    value = value.strip()
    if value.lower() in (RATE_LIMIT_OFF, "0", ""):
        return RATE_LIMIT_OFF
    try:
        parse(value)
    except ValueError as exc:
        raise ValueError(f"rate_limit must read like '1000/10 seconds' or '100 per second' (or 'off'), "
                         f"not {value!r}") from exc
    return value


class RequestLimits(BaseSettings):
    """``CAPSA_REQUEST_MAX_BODY_BYTES``, ``CAPSA_REQUEST_BODY_MEMORY_BYTES``,
    ``CAPSA_REQUEST_MAX_IN_FLIGHT`` and ``CAPSA_REQUEST_RATE_LIMIT``."""

    model_config = SettingsConfigDict(env_prefix="CAPSA_REQUEST_", extra="ignore")

    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    """Largest body of a route that reads its body whole (JSON bodies: sessions, secrets, policies, keys,
    nodes, E2B's REST API, MCP). A larger ``Content-Length`` is answered 413 ``payload_too_large`` before
    a byte of it is read; a chunked body is cut with 413 as soon as it passes the limit. Routes that pass
    their body on as it arrives (file and archive uploads, E2B uploads, the port proxy) have their own
    larger limits, and so do stdin writes and command requests (whose stdin may be 16 MiB)."""
    body_memory_bytes: Annotated[int, Field(ge=1 << 20)] = 256 << 20
    """Bytes of request bodies that routes reading their body whole may hold at once in this process: a
    request reserves its ``Content-Length`` (a chunked one its route's limit) before its body is read,
    and one that does not fit is answered 503 ``overloaded`` with ``Retry-After``. Streamed bodies do not
    count (the server reads them only as fast as they are passed on)."""
    drain_bytes: Annotated[int, Field(ge=0)] = 8 << 20
    """How far past its route's limit a declared body from a caller whose credential the gate accepted is
    read and thrown away before the 413, so that a client that writes its whole body before reading the
    answer (most do) gets the 413 instead of a reset connection. Unauthenticated bodies and bodies past
    this are refused without reading any of them (the client may see the connection close)."""
    max_in_flight: Annotated[int, Field(ge=1)] = 1024
    """HTTP requests and WebSocket connections this process serves at once (long streams included);
    beyond it, 503 ``overloaded`` with ``Retry-After``. While a request waits for its route to read its
    body the server holds at most 64 KiB of it, so this bounds what unread bodies cost too."""
    rate_limit: Annotated[str, AfterValidator(_rate)] = "1000/10 seconds"
    """Requests one client address may send (``limits``' notation: ``1000/10 seconds``, ``100 per
    second``); ``off`` turns it off. Beyond it: 429 ``rate_limited`` with ``Retry-After``. Behind a
    reverse proxy that does not pass the client's address (uvicorn trusts ``X-Forwarded-For`` from
    127.0.0.1 only), every client shares the proxy's: raise it, or turn it off and limit at the proxy.
    The node API counts only requests that do not carry its token (its callers are the control plane's
    replicas, which bound their own callers)."""

    def rate_item(self) -> RateLimitItem | None:
        """The parsed rate limit, or None when it is off."""
        return None if self.rate_limit == RATE_LIMIT_OFF else parse(self.rate_limit)

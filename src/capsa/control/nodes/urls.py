"""Which node URLs the control plane accepts (security finding 15).

The control plane sends a node its API token on every call and a session's secret values when it creates
the sandbox, so the channel must be private: ``https://`` anywhere, ``unix://`` (a local socket), or plain
``http://`` only to a loopback address (``localhost``, 127.0.0.0/8, ``::1``). A lab or test setup may allow
plain http elsewhere with ``CAPSA_ALLOW_INSECURE_NODE_URLS=1``.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

import httpx

from capsa.control.errors import ValidationFailed

__all__ = ["check_node_url", "is_loopback_host"]

# Visible ASCII only: no spaces, no control characters, no bytes an HTTP request line cannot carry.
_PRINTABLE = re.compile(r"[\x21-\x7e]+")


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_node_url(url: str, *, allow_insecure: bool, field: str = "body.url") -> None:
    """Raise ``validation_error`` (422) for a URL the control plane must not send tokens to, or one its
    HTTP client could not open (control characters, spaces, a bad port: ``urlsplit`` silently drops some
    of those, so the URL would pass here and fail later, when a heartbeat or a create calls the node)."""
    parts: SplitResult | None = None
    host = ""
    if _PRINTABLE.fullmatch(url):
        try:
            parts = urlsplit(url)
            host = parts.hostname or ""
            _ = parts.port  # raises ValueError when out of range or not a number
            if parts.scheme.lower() in ("http", "https"):
                httpx.URL(url)
        except (ValueError, httpx.InvalidURL):
            parts, host = None, ""
    scheme = parts.scheme.lower() if parts is not None else ""
    if scheme == "unix" or (scheme == "https" and host):
        return
    if scheme == "http" and host and (allow_insecure or is_loopback_host(host)):
        return
    if scheme == "http" and host:
        message = (f"node URL {url!r} is plain http:// off loopback: the node's API token and session "
                   "secrets would cross the network in clear; use https://, a unix:// socket, or set "
                   "CAPSA_ALLOW_INSECURE_NODE_URLS=1 on the control plane (labs and tests only)")
    else:
        message = f"node URL {url!r} is not https://host[:port], unix:///path or http://<loopback>"
    raise ValidationFailed(message, [{"field": field, "message": message}])

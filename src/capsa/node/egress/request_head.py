"""The checks of a request's head that need nothing but the head: framing, target and Host, path shape, the
declared body length and the upload ban. Each refusal is a :class:`~capsa.node.egress.http1.Deny`."""

from __future__ import annotations

from typing import Literal
from urllib.parse import unquote, urlsplit

from capsa.common.addresses import is_ip_literal
from capsa.common.egress_policy import DomainRule
from capsa.node.egress.http1 import Deny, Request, header

__all__ = ["Mode", "body_length", "check_framing", "check_path", "check_upload", "destination", "split_host"]

Mode = Literal["http", "tls", "proxy"]
"""Which listener a connection came in on: plain HTTP, TLS, or the explicit proxy."""


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise Deny(400, "malformed port")
    return int(text)


def split_host(value: str, default_port: int) -> tuple[str, int]:
    """(host, port) of a Host header or CONNECT target; the host lowercased, without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise Deny(400, "malformed host")
        host, rest = value[1:end], value[end + 1:]
        return host, (_port(rest[1:]) if rest.startswith(":") else default_port)
    if value.count(":") == 1:
        host, _, p = value.partition(":")
        return host.rstrip("."), _port(p)
    if ":" in value:
        return value, default_port  # bare IPv6 literal; refused as an IP literal later
    return value.rstrip("."), default_port


def check_framing(req: Request) -> None:
    names = [k for k, _ in req.headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        raise Deny(400, "request smuggling: both Content-Length and Transfer-Encoding")
    if b"upgrade" in names or b"http2-settings" in names:
        raise Deny(403, "protocol upgrade (h2c, websocket) refused")
    if req.method == "CONNECT":
        raise Deny(405, "CONNECT inside a tunnel or on this port refused")


def destination(req: Request, mode: Mode, tls: bool, pinned: str | None, default_port: int,
                http_port: int) -> None:
    """Check the request target against the Host header and the connection (its listener, TLS, the host it
    is pinned to), and set ``req.host``, ``req.port`` and ``req.path``."""
    host_values = header(req.headers, b"host")
    if len(host_values) != 1:
        raise Deny(400, "exactly one Host header is required")
    hh, hp = split_host(host_values[0].decode("latin-1"), default_port)
    target = req.target
    if target.startswith(("http://", "https://")):
        if mode != "proxy" or tls or not target.startswith("http://"):
            raise Deny(400, "absolute-form requests are only accepted by the proxy, for http://")
        parts = urlsplit(target)
        try:
            th, tp = (parts.hostname or ""), (parts.port or http_port)
        except ValueError:  # a port that is not a number or out of range
            raise Deny(400, "malformed port in the request target") from None
        if (th, tp) != (hh, hp):
            raise Deny(421, "request target and Host header disagree")
        req.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    elif not target.startswith("/"):
        raise Deny(400, "unsupported request target")
    elif mode == "proxy" and not tls:
        raise Deny(400, "the proxy needs absolute-form requests or CONNECT")
    if pinned is not None and hh != pinned:
        raise Deny(421, f"Host {hh[:255]} does not match the connection's host {pinned}"
                   + (" (TLS server name)" if tls else " (no host switching on keep-alive)"))
    if hp not in (default_port, 443 if tls else 80):
        raise Deny(403, f"port {hp} is not allowed")
    if is_ip_literal(hh):
        raise Deny(403, "IP-literal destinations are refused")
    req.host, req.port = hh, hp
    check_path(req.path)


def check_path(path: str) -> None:
    raw = path.split("?", 1)[0]
    decoded = unquote(raw)
    segments = decoded.split("/")
    if ".." in segments or "." in segments or "\\" in decoded or "\x00" in decoded or "//" in raw:
        raise Deny(400, "path with dot segments, backslashes or empty segments refused")


def check_upload(rule: DomainRule, size: int | None) -> None:
    """Refuse a body over the rule's ``forbid_uploads_above`` (declared or counted so far)."""
    cap = rule.forbid_uploads_above
    if cap is not None and size is not None and size > cap:
        what = "any request body" if cap == 0 else f"request bodies over {cap} bytes"
        raise Deny(403, f"uploads to {rule.domain} are forbidden ({what})", rule=rule.domain)


def body_length(req: Request, rule: DomainRule, limit: int) -> int | None:
    """The request body's declared length (None: chunked), refused up front when over ``limit``."""
    if header(req.headers, b"transfer-encoding"):
        return None  # h11 accepts only chunked; the size is checked as it streams
    lengths = header(req.headers, b"content-length")
    length = int(lengths[0]) if lengths else 0  # h11 has checked the value
    if length > limit:
        raise Deny(413, f"request body over {limit} bytes", rule=rule.domain)
    return length

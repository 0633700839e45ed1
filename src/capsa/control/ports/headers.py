"""What the port proxy lets through of an app's response headers, and what it adds.

An app in a sandbox is untrusted. On the API's path route (no ``CAPSA_PORTS_DOMAIN``) its pages share the
API's origin with every other session's ports, so a header that acts on the whole origin (or on the site)
would let it act on the API's origin and on other sessions' tabs. Those are dropped:

- ``Set-Cookie`` with a ``Domain`` (a cookie for the API's host and its subdomains), a ``Path`` outside the
  port's own path (a cookie for the API or for another session's port: cookie tossing, a port token fixed
  in a victim's tab), a ``__Host-``/``__Secure-`` name (they claim an origin-wide cookie), or the proxy's own
  ``capsa_port_token``. A cookie without ``Path`` defaults to the request's directory, inside the port.
- ``Clear-Site-Data`` (it clears the cookies, storage and caches of the whole site: other sessions' tokens).
- ``Service-Worker-Allowed`` (a service worker whose scope is the API's origin would see every other
  port's requests, tokens in their URLs).
- ``Strict-Transport-Security``, ``Alt-Svc``, ``NEL``, ``Report-To``, ``Reporting-Endpoints``, ``Accept-CH``,
  ``Critical-CH``, ``Public-Key-Pins``, ``Expect-CT``, ``Set-Cookie2``: policies a browser keeps for the
  whole origin (HSTS for its subdomains, another endpoint for its traffic, reports of its requests' URLs
  sent to the app's collector, client hints).

and ``Referrer-Policy: no-referrer`` replaces the app's, so a URL carrying a token is never sent on as a
``Referer``.

On a port's own host (``<port>-<id>.<domain>``) the origin is the app's alone: cookies, service workers and
its own policies stay (only ``Domain`` is stripped from cookies, which would otherwise reach every session's
host under the domain, and ``Clear-Site-Data``, ``Alt-Svc`` and ``NEL``/reporting, which reach beyond the
host, are dropped); the app's ``Referrer-Policy`` is kept, since tokens ride in its URLs only on the first
request and browsers send only the origin across origins by default.
"""

from __future__ import annotations

from collections.abc import Iterable

from capsa.control.ports.access import TOKEN_COOKIE

__all__ = ["REFERRER_POLICY", "response_headers"]

REFERRER_POLICY = (b"referrer-policy", b"no-referrer")

_SITE_WIDE = frozenset({b"clear-site-data", b"alt-svc", b"nel", b"report-to", b"reporting-endpoints"})
"""Dropped on both routes: they act beyond the responding host."""
_ORIGIN_WIDE = _SITE_WIDE | frozenset({
    b"service-worker-allowed", b"strict-transport-security", b"accept-ch", b"critical-ch",
    b"public-key-pins", b"public-key-pins-report-only", b"expect-ct", b"set-cookie2", b"referrer-policy",
})
"""Dropped on the path route (shared origin)."""


def _cookie_attributes(value: str) -> tuple[str, dict[str, str]]:
    """A Set-Cookie value's name and its attributes (lower-case names; the last of each wins, as in
    browsers)."""
    first, *rest = value.split(";")
    name = first.split("=", 1)[0].strip()
    attributes: dict[str, str] = {}
    for part in rest:
        key, _, val = part.partition("=")
        attributes[key.strip().lower()] = val.strip()
    return name, attributes


def _without_domain(value: str) -> str:
    first, *rest = value.split(";")
    return ";".join([first, *(p for p in rest if p.split("=", 1)[0].strip().lower() != "domain")])


def _cookie(value: str, port_path: str | None) -> str | None:
    """The Set-Cookie value to pass on (None: dropped). ``port_path``: the path route's prefix; None on a
    port's own host."""
    name, attributes = _cookie_attributes(value)
    if not name or name == TOKEN_COOKIE:
        return None
    if port_path is None:
        return _without_domain(value)
    if "domain" in attributes or name.lower().startswith(("__host-", "__secure-")):
        return None
    path = attributes.get("path")
    if path is not None and not (path.rstrip("/") + "/").startswith(port_path):
        return None
    return value


Header = tuple[bytes, bytes]


def response_headers(headers: Iterable[Header], port_path: str | None) -> list[Header]:
    """The app's response headers (lower-case names, hop-by-hop ones already gone) as the client gets them:
    ``port_path`` is the path route's prefix (``/v1/sessions/{id}/ports/{port}/``), or None when the request
    came to the port's own host."""
    drop = _SITE_WIDE if port_path is None else _ORIGIN_WIDE
    out: list[Header] = []
    for name, value in headers:
        if name in drop:
            continue
        if name == b"set-cookie":
            kept = _cookie(value.decode("latin-1"), port_path)
            if kept is None:
                continue
            value = kept.encode("latin-1")
        out.append((name, value))
    if port_path is not None:
        out.append(REFERRER_POLICY)
    return out

"""Building request paths: one quoted segment per id, so an id can never address another route."""

from __future__ import annotations

from urllib.parse import quote

from capsa.sdk.errors import CapsaClientError

__all__ = ["seg"]


def seg(value: str) -> str:
    """Quote one path segment so an id like ``../keys`` can never address another route."""
    if not value:
        raise CapsaClientError("an id must not be empty")
    return quote(value, safe="")

"""Secret placeholders: the opaque tokens a sandbox holds instead of its secrets.

Made by the control plane (the record of a session's placeholders, sent with every sandbox start) and, for
callers of the node API that send none, by the node; the node's broker swaps one for its secret only in the
bound header, towards the bound host, for the sandbox whose policy binds it.
"""

from __future__ import annotations

import re
import secrets

__all__ = ["PLACEHOLDER_PREFIX", "is_placeholder", "new_placeholder"]

PLACEHOLDER_PREFIX = "capsa_ph_"
_PLACEHOLDER_RE = re.compile(r"^" + PLACEHOLDER_PREFIX + r"[A-Za-z0-9_-]{16,128}$")


def new_placeholder() -> str:
    """A random opaque token (~190 bits) that means nothing outside the broker."""
    return PLACEHOLDER_PREFIX + secrets.token_urlsafe(24)


def is_placeholder(text: str) -> bool:
    """Whether ``text`` has the form of a placeholder (as :func:`new_placeholder` makes them)."""
    return _PLACEHOLDER_RE.match(text) is not None

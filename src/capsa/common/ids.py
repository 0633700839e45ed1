"""Prefixed random identifiers (``ses_…``, ``sbx_…``, ``key_…``)."""

from __future__ import annotations

import re
import secrets

__all__ = ["is_id", "new_id"]

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_ID_RE = re.compile(r"^[a-z]{2,5}_[0-9a-z]{20}$")


def new_id(prefix: str) -> str:
    """Return ``<prefix>_`` followed by 20 random base-36 characters (~103 bits)."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(20))


def is_id(value: str, prefix: str | None = None) -> bool:
    if not _ID_RE.match(value):
        return False
    return prefix is None or value.startswith(prefix + "_")

"""Prefixed random identifiers (``ses_…``, ``sbx_…``, ``key_…``)."""

from __future__ import annotations

import re
import secrets

__all__ = ["is_id", "new_id"]

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_ID_RE = re.compile(r"^[a-z]{2,5}_[0-9a-z]{20}$")


_SPACE = len(_ALPHABET) ** 20  # ~2^103.4


def new_id(prefix: str) -> str:
    """Return ``<prefix>_`` followed by 20 random base-36 characters (~103 bits)."""
    # One 104-bit draw, redrawn when it falls outside 36^20 (about a third of the time), so every id is
    # equally likely; 20 secrets.choice calls cost 20 reads of the system's random source.
    while (value := int.from_bytes(secrets.token_bytes(13), "big")) >= _SPACE:
        pass
    chars = []
    for _ in range(20):
        value, digit = divmod(value, 36)
        chars.append(_ALPHABET[digit])
    return prefix + "_" + "".join(chars)


def is_id(value: str, prefix: str | None = None) -> bool:
    if not _ID_RE.match(value):
        return False
    return prefix is None or value.startswith(prefix + "_")

"""API key format: ``csk_<12 char id>_<32 char secret>``; only a SHA-256 hash of the whole key is stored."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

__all__ = ["ParsedKey", "generate_key", "hash_key", "parse_key", "verify_key"]

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_KEY_RE = re.compile(r"^(csk_[0-9a-z]{12})_([0-9A-Za-z]{32})$")


@dataclass(frozen=True)
class ParsedKey:
    key_id: str
    full: str


def _random(n: int, alphabet: str) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def generate_key() -> ParsedKey:
    key_id = "csk_" + _random(12, _ALPHABET)
    secret = _random(32, _ALPHABET + "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return ParsedKey(key_id, f"{key_id}_{secret}")


def parse_key(value: str) -> ParsedKey | None:
    match = _KEY_RE.match(value)
    return ParsedKey(match.group(1), value) if match else None


def hash_key(full: str) -> str:
    return hashlib.sha256(full.encode()).hexdigest()


def verify_key(full: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(full), stored_hash)

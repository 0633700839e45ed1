"""API key format, hashing and parsing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from capsa.control.keys import generate_key, hash_key, parse_key, verify_key


def test_generated_keys_have_the_documented_shape() -> None:
    key = generate_key()
    prefix, ident, secret = key.full.split("_")
    assert prefix == "csk" and len(ident) == 12 and len(secret) == 32
    assert key.key_id == f"csk_{ident}"
    assert parse_key(key.full) == key
    assert generate_key().full != key.full


def test_hash_is_sha256_and_verification_is_exact() -> None:
    key = generate_key().full
    stored = hash_key(key)
    assert len(stored) == 64 and key not in stored
    assert verify_key(key, stored)
    assert not verify_key(key[:-1] + ("a" if key[-1] != "a" else "b"), stored)


@given(st.text(max_size=80))
def test_parse_never_accepts_malformed_keys(value: str) -> None:
    parsed = parse_key(value)
    if parsed is not None:
        assert parsed.full == value and value.startswith("csk_") and len(value) == 4 + 12 + 1 + 32

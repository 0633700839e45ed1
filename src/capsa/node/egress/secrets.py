"""Secrets at rest and the placeholders that stand in for them inside a sandbox.

A secret value is only ever held encrypted (AES-256-GCM, the secret's id bound as associated data so a
ciphertext cannot be swapped between records) and is decrypted by the broker for the one request it is
injected into. The sandbox sees only a random per-session placeholder.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from capsa.common.errors import CapsaError
from capsa.common.placeholders import PLACEHOLDER_PREFIX, is_placeholder, new_placeholder

__all__ = [
    "PLACEHOLDER_PREFIX",
    "InMemorySecretStore",
    "SecretBox",
    "SecretError",
    "SecretStore",
    "is_placeholder",
    "new_placeholder",
]

_VERSION = b"\x01"


class SecretError(CapsaError):
    code = "secret_error"
    status = 500


class SecretBox:
    """Encrypts and decrypts secret values with a 256-bit key from the node's configuration."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise SecretError("the secrets key must be 32 bytes (base64 of 32 random bytes)",
                              code="invalid_secrets_key")
        self._aead = AESGCM(key)

    @classmethod
    def from_b64(cls, text: str) -> SecretBox:
        try:
            key = base64.b64decode(text.strip(), validate=True)
        except ValueError:
            raise SecretError("the secrets key is not valid base64", code="invalid_secrets_key") from None
        return cls(key)

    @staticmethod
    def generate_key() -> str:
        return base64.b64encode(os.urandom(32)).decode()

    def encrypt(self, secret_id: str, value: str) -> bytes:
        nonce = os.urandom(12)
        return _VERSION + nonce + self._aead.encrypt(nonce, value.encode(), secret_id.encode())

    def decrypt(self, secret_id: str, blob: bytes) -> str:
        if len(blob) < 1 + 12 + 16 or blob[:1] != _VERSION:
            raise SecretError(f"stored secret {secret_id} is malformed", code="secret_corrupt")
        try:
            plain = self._aead.decrypt(blob[1:13], blob[13:], secret_id.encode())
        except InvalidTag:
            raise SecretError(f"stored secret {secret_id} cannot be decrypted with this key",
                              code="secret_corrupt") from None
        return plain.decode()


class SecretStore(Protocol):
    """Where the broker fetches a secret value by reference, at the moment it injects it."""

    def reveal(self, secret_id: str) -> str: ...


@dataclass
class InMemorySecretStore:
    """Encrypted secrets held by the node for its running sandboxes (pushed by the control plane)."""

    box: SecretBox
    _blobs: dict[str, bytes]

    def __init__(self, box: SecretBox, values: Mapping[str, str] | None = None) -> None:
        self.box = box
        self._blobs = {}
        for sid, value in (values or {}).items():
            self.put(sid, value)

    def put(self, secret_id: str, value: str) -> None:
        if not value:
            raise SecretError("a secret value cannot be empty", code="invalid_secret", status=422)
        self._blobs[secret_id] = self.box.encrypt(secret_id, value)

    def delete(self, secret_id: str) -> None:
        self._blobs.pop(secret_id, None)

    def ids(self) -> list[str]:
        return list(self._blobs)

    def reveal(self, secret_id: str) -> str:
        blob = self._blobs.get(secret_id)
        if blob is None:
            raise SecretError(f"unknown secret {secret_id}", code="secret_not_found", status=404)
        return self.box.decrypt(secret_id, blob)

    def __repr__(self) -> str:  # never print values, not even encrypted ones
        return f"InMemorySecretStore({len(self._blobs)} secrets)"


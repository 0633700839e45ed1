"""Encryption at rest of the secrets users store (AES-256-GCM under a key from the configuration).

The tenant and the secret's id are bound as associated data: a ciphertext copied to another record or
tenant in the database does not decrypt.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from capsa.control.errors import ApiError
from capsa.control.settings import ControlSettings

__all__ = ["SecretSealer", "ensure_key_file"]

_VERSION = b"\x01"


class SecretSealer:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("the secret key must be 32 bytes (base64 of 32 random bytes)")
        self._aead = AESGCM(key)

    @classmethod
    def from_text(cls, text: str) -> SecretSealer:
        try:
            return cls(base64.b64decode(text.strip(), validate=True))
        except (binascii.Error, ValueError):
            raise ValueError("the secret key is not base64 of 32 bytes") from None

    @classmethod
    def from_settings(cls, settings: ControlSettings) -> SecretSealer | None:
        """The configured sealer, or None when no key is configured (the secrets API then answers 503)."""
        if settings.secret_key is not None:
            return cls.from_text(settings.secret_key.get_secret_value())
        if settings.secret_key_file is not None:
            return cls.from_text(settings.secret_key_file.read_text())
        return None

    @staticmethod
    def _aad(tenant: str, secret_id: str) -> bytes:
        return f"{tenant}\x00{secret_id}".encode()

    def seal(self, tenant: str, secret_id: str, value: str) -> bytes:
        nonce = os.urandom(12)
        return _VERSION + nonce + self._aead.encrypt(nonce, value.encode(), self._aad(tenant, secret_id))

    def open(self, tenant: str, secret_id: str, blob: bytes) -> str:
        try:
            if blob[:1] != _VERSION:
                raise InvalidTag
            return self._aead.decrypt(blob[1:13], blob[13:], self._aad(tenant, secret_id)).decode()
        except InvalidTag:
            raise ApiError(f"secret {secret_id} cannot be decrypted with the configured key",
                           code="secret_corrupt", status=500) from None

    def __repr__(self) -> str:
        return "SecretSealer(<key hidden>)"


def ensure_key_file(path: Path) -> Path:
    """Create ``path`` with a fresh key (mode 0600, never replacing an existing file) and return it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
    return path

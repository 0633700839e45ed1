"""The secrets of nodes: one-time enrolment tokens and node credentials (stored as SHA-256), and the node
API tokens the control plane presents to nodes (stored encrypted, since the plane must present them).

The encryption key is the control plane's secret key (``CAPSA_SECRET_KEY`` / ``CAPSA_SECRET_KEY_FILE``, see
:mod:`capsa.control.secretbox`). Without one, a key is derived from the configured bootstrap admin key, which
every replica is given too; with neither, nodes cannot be registered (503 ``secret_key_missing``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from capsa.control.errors import ApiError
from capsa.control.secretbox import SecretSealer
from capsa.control.settings import ControlSettings

__all__ = [
    "NodeSealer",
    "derive_secret_key",
    "hash_secret",
    "new_credential",
    "new_enrol_token",
    "node_sealer",
    "secret_matches",
]

# Associated data that no tenant name can produce (tenants never contain NUL).
_AAD_TENANT = "\x00nodes"
_ENROL_PREFIX = "cne_"
_CREDENTIAL_PREFIX = "cnc_"


def hash_secret(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def secret_matches(value: str | None, stored_hash: str | None) -> bool:
    if value is None or stored_hash is None:
        return False
    return hmac.compare_digest(hash_secret(value), stored_hash)


def new_enrol_token() -> str:
    return _ENROL_PREFIX + secrets.token_urlsafe(32)


def new_credential() -> str:
    return _CREDENTIAL_PREFIX + secrets.token_urlsafe(32)


class NodeSealer:
    """Encrypts a node's API token bound to the node's id (a ciphertext moved to another row won't open)."""

    def __init__(self, sealer: SecretSealer) -> None:
        self._sealer = sealer

    def seal(self, node_id: str, token: str) -> bytes:
        return self._sealer.seal(_AAD_TENANT, node_id, token)

    def open(self, node_id: str, blob: bytes) -> str:
        try:
            return self._sealer.open(_AAD_TENANT, node_id, blob)
        except ApiError:
            raise ApiError(f"node {node_id}'s API token does not decrypt with this replica's secret key "
                           "(replicas must share CAPSA_SECRET_KEY); the node must register again",
                           code="node_token_unreadable", status=503) from None

    def __repr__(self) -> str:
        return "NodeSealer(<key hidden>)"


def derive_secret_key(bootstrap_key: str) -> str:
    """A secret key (base64, as ``CAPSA_SECRET_KEY`` takes it) derived from the bootstrap admin key.

    Every replica given the same bootstrap key derives the same key; the database holds only the bootstrap
    key's SHA-256, from which this cannot be computed.
    """
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=b"capsa secret key").derive(bootstrap_key.encode())
    return base64.b64encode(key).decode()


def node_sealer(settings: ControlSettings) -> NodeSealer | None:
    sealer = SecretSealer.from_settings(settings)
    if sealer is None and settings.bootstrap_key:
        sealer = SecretSealer.from_text(derive_secret_key(settings.bootstrap_key))
    return NodeSealer(sealer) if sealer is not None else None

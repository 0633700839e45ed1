"""Per-sandbox envd access tokens: E2B's ``envdAccessToken``, scoped to one sandbox's envd calls.

A token is ``cet_<key id>_<mac>``: the HMAC-SHA256 of the API key's id and the session id under a key
derived (HKDF) from the control plane's secret key (``CAPSA_SECRET_KEY`` / ``CAPSA_SECRET_KEY_FILE``, else
the bootstrap admin key, as node tokens are sealed), so every replica mints and checks the same tokens and
the database holds nothing from which one could be made. It authenticates as its API key (revoking the key
ends it) but only for envd calls naming its own sandbox in ``E2b-Sandbox-Id``: it is no API key, so
``/v1`` and E2B's REST API refuse it, and another sandbox's envd refuses it too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from capsa.control.auth import Principal, key_principal
from capsa.control.errors import ApiError, Unauthorized
from capsa.control.nodes.secrets import derive_secret_key
from capsa.control.plane import ControlPlane
from capsa.control.settings import ControlSettings

__all__ = ["TOKEN_PREFIX", "is_access_token", "mint", "principal_of"]

TOKEN_PREFIX = "cet_"
_TOKEN_RE = re.compile(r"^cet_([0-9a-z]{12})_([A-Za-z0-9_-]{43})$")
_KEY_PREFIX = "csk_"
_INFO = b"capsa e2b envd access token"
_keys: dict[int, tuple[ControlSettings, bytes]] = {}


def _secret(settings: ControlSettings) -> bytes:
    """The MAC key of this plane's tokens (derived once per settings object)."""
    known = _keys.get(id(settings))
    if known is not None and known[0] is settings:
        return known[1]
    if settings.secret_key is not None:
        text = settings.secret_key.get_secret_value()
    elif settings.secret_key_file is not None:
        text = settings.secret_key_file.read_text()
    elif settings.bootstrap_key:
        text = derive_secret_key(settings.bootstrap_key)
    else:
        raise ApiError("envd access tokens are signed with the control plane's secret key: set "
                       "CAPSA_SECRET_KEY (or CAPSA_SECRET_KEY_FILE) or CAPSA_BOOTSTRAP_KEY",
                       code="secret_key_missing", status=503)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(
        base64.b64decode(text.strip()))
    _keys[id(settings)] = (settings, key)
    return key


def _mac(settings: ControlSettings, key_id: str, session_id: str) -> str:
    digest = hmac.new(_secret(settings), f"{key_id}\x00{session_id}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def is_access_token(token: str) -> bool:
    return token.startswith(TOKEN_PREFIX)


def mint(settings: ControlSettings, key_id: str, session_id: str) -> str:
    """The envd access token of ``session_id`` for the API key ``key_id`` (``csk_…``)."""
    assert key_id.startswith(_KEY_PREFIX), key_id
    return f"{TOKEN_PREFIX}{key_id[len(_KEY_PREFIX):]}_{_mac(settings, key_id, session_id)}"


async def principal_of(control: ControlPlane, token: str, session_id: str) -> Principal:
    """Who ``token`` speaks for on ``session_id``'s envd: its API key, if the token was minted for this
    session and the key is not revoked; else ``Unauthorized``."""
    match = _TOKEN_RE.match(token)
    if match is None:
        raise Unauthorized()
    key_id = _KEY_PREFIX + match.group(1)
    if not hmac.compare_digest(match.group(2), _mac(control.settings, key_id, session_id)):
        raise Unauthorized()
    return await key_principal(control.db, control.keys, key_id)

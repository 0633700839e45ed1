"""Signatures of the notifications capsa POSTs to webhooks (approval notices).

A notification carries ``X-Capsa-Timestamp: <unix seconds>`` and ``X-Capsa-Signature: v1=<hex>``, where the
hex is HMAC-SHA256 under the deployment's key (``CAPSA_APPROVAL_WEBHOOK_SECRET``) of
``<timestamp>.<raw body>``. A receiver recomputes it over the raw bytes it received, compares in constant
time, and refuses timestamps outside its tolerance (a replayed notice is then refused). ``X-Capsa-Delivery``
is a unique id per POST, for deduplication.
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["DELIVERY_HEADER", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "sign", "verify"]

SIGNATURE_HEADER = "X-Capsa-Signature"
TIMESTAMP_HEADER = "X-Capsa-Timestamp"
DELIVERY_HEADER = "X-Capsa-Delivery"
_SCHEME = "v1"


def _mac(key: bytes, timestamp: int, body: bytes) -> str:
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(key: bytes, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The timestamp and signature headers of ``body``."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: f"{_SCHEME}={_mac(key, ts, body)}"}


def verify(key: bytes, body: bytes, timestamp: str, signature: str, *, tolerance_s: float = 300.0,
           now: float | None = None) -> bool:
    """Whether ``signature`` (the header's value) signs ``body`` at ``timestamp`` under ``key``, and the
    timestamp is within ``tolerance_s`` of ``now``."""
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    expected = _mac(key, ts, body)
    parts = (part.strip() for part in signature.split(","))
    return any(hmac.compare_digest(part.partition("=")[2], expected)
               for part in parts if part.startswith(f"{_SCHEME}="))

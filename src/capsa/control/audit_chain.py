"""The hash of an audit-chain event: SHA-256 over a canonical JSON encoding that includes the hash of
the tenant's previous event, so editing, deleting or reordering any event breaks every hash after it.

Canonical form (version 1): a JSON object with exactly the keys ``v`` (1), ``tenant``, ``seq``,
``time_us``, ``kind``, ``action``, ``key_id``, ``request_id``, ``session_id``, ``detail`` and
``prev_hash``; keys sorted at every level, no whitespace (``","`` and ``":"`` separators), ASCII only
(``\\uXXXX`` escapes), no NaN or infinities, integers as integers; encoded as ASCII bytes. The hash is
the lowercase hex SHA-256 of those bytes. The first event of a tenant has ``prev_hash`` = 64 zeros
(:data:`GENESIS`). A verifier needs only the exported events (``capsa audit export``) to recompute it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CANONICAL_VERSION", "GENESIS", "ChainFields", "canonical_bytes", "event_hash",
           "normalize_detail"]

CANONICAL_VERSION = 1
GENESIS = "0" * 64


@dataclass(frozen=True)
class ChainFields:
    """What an event's hash covers (everything stored about it except the hash itself)."""

    tenant: str
    seq: int
    time_us: int
    kind: str
    action: str
    key_id: str | None
    request_id: str | None
    session_id: str | None
    detail: Mapping[str, Any]
    prev_hash: str


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def normalize_detail(detail: Mapping[str, Any] | None) -> dict[str, Any]:
    """The detail as it reads back from a JSON column (tuples become lists, keys strings), so the hash
    of what is stored is the hash that was computed. Raises ``ValueError`` for what JSON cannot hold."""
    try:
        normalized = json.loads(json.dumps(dict(detail or {}), ensure_ascii=True, allow_nan=False))
    except TypeError as exc:
        raise ValueError(f"audit detail is not JSON: {exc}") from None
    assert isinstance(normalized, dict)
    return normalized


def canonical_bytes(fields: ChainFields) -> bytes:
    return _dumps({
        "v": CANONICAL_VERSION, "tenant": fields.tenant, "seq": fields.seq, "time_us": fields.time_us,
        "kind": fields.kind, "action": fields.action, "key_id": fields.key_id,
        "request_id": fields.request_id, "session_id": fields.session_id, "detail": dict(fields.detail),
        "prev_hash": fields.prev_hash,
    }).encode("ascii")


def event_hash(fields: ChainFields) -> str:
    return hashlib.sha256(canonical_bytes(fields)).hexdigest()

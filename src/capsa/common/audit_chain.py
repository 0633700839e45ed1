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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CANONICAL_VERSION", "GENESIS", "ChainFields", "OfflineResult", "canonical_bytes", "event_hash",
           "normalize_detail", "verify_export"]

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


@dataclass(frozen=True)
class OfflineResult:
    checked: int
    broken_id: int | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.broken_id is None


def verify_export(records: Iterable[Mapping[str, Any]]) -> OfflineResult:
    """Check exported events (``capsa audit export`` of a whole chain, or of a contiguous stretch of it)
    without the server: ids consecutive, each ``prev_hash`` the previous ``hash`` (64 zeros before event
    1), each ``hash`` recomputed from the event's fields."""
    checked = 0
    expected: int | None = None
    prev: str | None = None
    for record in records:
        try:
            fields = ChainFields(tenant=str(record["tenant"]), seq=int(record["id"]),
                                 time_us=int(record["time_us"]), kind=str(record["kind"]),
                                 action=str(record["action"]), key_id=record.get("key_id"),
                                 request_id=record.get("request_id"), session_id=record.get("session_id"),
                                 detail=dict(record.get("detail") or {}), prev_hash=str(record["prev_hash"]))
            stored = str(record["hash"])
        except (KeyError, TypeError, ValueError) as exc:
            return OfflineResult(checked, int(record.get("id", expected or 0) or 0),
                                 f"malformed event: {exc}")
        if expected is not None and fields.seq != expected:
            return OfflineResult(checked, expected, f"event {expected} is missing (the next exported "
                                                    f"event is {fields.seq})")
        if prev is None and fields.seq == 1:
            prev = GENESIS
        if prev is not None and fields.prev_hash != prev:
            return OfflineResult(checked, fields.seq, "prev_hash does not match the hash of event "
                                                      f"{fields.seq - 1}")
        if event_hash(fields) != stored:
            return OfflineResult(checked, fields.seq, "hash does not match the event's content (edited)")
        checked += 1
        expected, prev = fields.seq + 1, stored
    return OfflineResult(checked)

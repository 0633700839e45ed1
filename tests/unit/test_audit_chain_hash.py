"""The canonical form and hash of an audit-chain event (capsa.common.audit_chain)."""

from __future__ import annotations

import hashlib
import json

import pytest

from capsa.common.audit_chain import GENESIS, ChainFields, canonical_bytes, event_hash, normalize_detail


def _fields(**changes: object) -> ChainFields:
    values: dict[str, object] = {
        "tenant": "acme", "seq": 1, "time_us": 1_700_000_000_123_456, "kind": "command", "action": "run",
        "key_id": "csk_abcdefghijkl", "request_id": "req_0123456789abcdefghij",
        "session_id": "ses_0123456789abcdefghij", "detail": {"argv": ["ls", "-l"], "exit_code": 0},
        "prev_hash": GENESIS}
    values.update(changes)
    return ChainFields(**values)  # type: ignore[arg-type]


def test_canonical_form_is_sorted_compact_ascii_json() -> None:
    raw = canonical_bytes(_fields(detail={"b": 1, "a": {"z": "é", "y": None}}))
    assert raw == (b'{"action":"run","detail":{"a":{"y":null,"z":"\\u00e9"},"b":1},'
                   b'"key_id":"csk_abcdefghijkl",'
                   b'"kind":"command","prev_hash":"' + GENESIS.encode() + b'","request_id":'
                   b'"req_0123456789abcdefghij","seq":1,"session_id":"ses_0123456789abcdefghij",'
                   b'"tenant":"acme","time_us":1700000000123456,"v":1}')
    assert event_hash(_fields()) == hashlib.sha256(canonical_bytes(_fields())).hexdigest()
    # Key order in the detail does not matter; every value does.
    assert event_hash(_fields(detail={"exit_code": 0, "argv": ["ls", "-l"]})) == event_hash(_fields())


@pytest.mark.parametrize("change", [
    {"tenant": "other"}, {"seq": 2}, {"time_us": 1_700_000_000_123_457}, {"kind": "file"},
    {"action": "start"}, {"key_id": None}, {"request_id": "req_x"}, {"session_id": None},
    {"detail": {"argv": ["ls"], "exit_code": 0}}, {"prev_hash": "f" * 64},
])
def test_every_field_is_covered(change: dict[str, object]) -> None:
    assert event_hash(_fields(**change)) != event_hash(_fields())


def test_detail_normalized_as_a_json_column_reads_it_back() -> None:
    assert normalize_detail({"t": (1, 2), 3: "x", "n": None}) == {"t": [1, 2], "3": "x", "n": None}
    assert normalize_detail(None) == {}
    with pytest.raises(ValueError):
        normalize_detail({"x": float("nan")})
    detail = normalize_detail({"f": 0.1, "big": 2**62})
    assert json.loads(json.dumps(detail)) == detail


async def test_node_calls_carry_the_api_request_id() -> None:
    import httpx

    from capsa.control.audit import trail as audit_trail
    from capsa.control.nodes.client import NodeClient

    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return httpx.Response(200, json={"epoch": "e", "items": [], "last_seq": 0, "lost": 0})

    client = NodeClient("http://node.test", "tok", transport=httpx.MockTransport(answer))
    try:
        await client.audit(after=0, epoch=None, limit=10)
        token = audit_trail.bind(audit_trail.RequestAudit(request_id="req_0123456789abcdefghij"))
        try:
            await client.audit(after=0, epoch=None, limit=10)
        finally:
            audit_trail.unbind(token)
    finally:
        await client.aclose()
    assert seen == [None, "req_0123456789abcdefghij"]


def test_long_command_lines_are_recorded_cut_with_the_hash_of_the_whole() -> None:
    from capsa.control.routes.commands import AUDIT_ARGV_BYTES, argv_detail

    assert argv_detail(["ls", "-l"]) == {"argv": ["ls", "-l"], "shell": False}
    huge = ["python3", "-c", "x" * (2 * AUDIT_ARGV_BYTES)]
    cut = argv_detail(huge)
    assert cut["argv_truncated"] is True
    assert cut["argv_sha256"] == hashlib.sha256(json.dumps(huge).encode()).hexdigest()
    assert len(json.dumps(cut["argv"])) <= AUDIT_ARGV_BYTES and cut["argv"][:2] == ["python3", "-c"]
    line = argv_detail("y" * (3 * AUDIT_ARGV_BYTES))
    assert line["shell"] is True and len(str(line["argv"])) == AUDIT_ARGV_BYTES // 2

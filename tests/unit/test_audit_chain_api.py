"""The tenant audit chain through the real API stack (fake runtime): one linked chain per tenant for a
whole run (create -> commands -> file transfers -> close), request ids on responses and events, tamper
detection by ``/v1/audit/verify`` and ``capsa audit verify``, export, and tenant isolation. Runs on SQLite
and PostgreSQL (``db_url``)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from capsa.cli.main import cli
from tests.support.api_stack import ApiStack

pytestmark = [pytest.mark.timeout(180), pytest.mark.postgresql]


async def _cli(stack: ApiStack, key: str, *args: str) -> Result:
    env = {"CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)


async def _sql(db_url: str, statement: str, **params: object) -> None:
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(statement), params)
    finally:
        await engine.dispose()


async def _chain(client: Any, **params: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {}), "limit": 50}
        page = await client.get("/v1/audit", params=query)
        assert page.status_code == 200, page.text
        items += page.json()["items"]
        cursor = page.json()["next_cursor"]
        if not cursor:
            return items


async def test_a_run_is_one_linked_chain_and_tampering_is_named(
        make_stack: Callable[..., Awaitable[ApiStack]], db_url: str, tmp_path: Path) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    payload = b"hello audit\n" * 1000
    async with stack.client(key) as a:
        created = await a.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        create_request = created.headers["x-request-id"]
        assert create_request.startswith("req_")
        ran = await a.post(f"/v1/sessions/{sid}/commands",
                           json={"cmd": ["sh", "-c", "exit 3"], "cwd": "/tmp"})
        assert ran.json()["exit_code"] == 3
        streamed = await a.post(f"/v1/sessions/{sid}/commands", json={"cmd": "echo hi"},
                                headers={"Accept": "application/x-ndjson"})
        assert streamed.status_code == 200 and '"result"' in streamed.text
        written = await a.put(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/a.txt"},
                              content=payload)
        assert written.status_code == 200, written.text
        read = await a.get(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/a.txt"})
        assert read.content == payload
        assert (await a.delete(f"/v1/sessions/{sid}/files", params={"path": "/tmp/a.txt"})).status_code == 204
        closed = await a.post(f"/v1/sessions/{sid}/close")
        assert closed.status_code == 200
        events = await _chain(a)
    ids = [e["id"] for e in events]
    assert ids == list(range(1, len(ids) + 1))
    for before, after in itertools.pairwise(events):
        assert after["prev_hash"] == before["hash"]
    kinds = [(e["kind"], e["action"]) for e in events]
    for wanted in (("session", "create"), ("command", "run"), ("file", "upload"), ("file", "download"),
                   ("file", "delete"), ("session", "close"), ("api", "call")):
        assert wanted in kinds, (wanted, kinds)
    by_request: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_request.setdefault(e["request_id"], []).append(e)
    assert {(e["kind"], e["action"]) for e in by_request[create_request]} == {("api", "call"),
                                                                             ("session", "create")}
    assert all(e["session_id"] == sid for e in by_request[create_request])
    commands = [e for e in events if e["kind"] == "command"]
    assert commands[0]["detail"]["argv"] == ["sh", "-c", "exit 3"]
    assert commands[0]["detail"]["exit_code"] == 3 and commands[0]["detail"]["cwd"] == "/tmp"
    assert commands[1]["detail"]["exit_code"] == 0
    digest = hashlib.sha256(payload).hexdigest()
    transfers = {e["action"]: e["detail"] for e in events if e["kind"] == "file"}
    assert transfers["upload"]["sha256"] == digest and transfers["upload"]["size"] == len(payload)
    assert transfers["download"]["sha256"] == digest
    api = [e for e in events if e["kind"] == "api"]
    assert all(e["key_id"] == key.rsplit("_", 1)[0] for e in api)
    routes = {f"{e['detail']['method']} {e['detail']['route']}" for e in api}
    assert {"POST /v1/sessions", "POST /v1/sessions/{session_id}/commands",
            "PUT /v1/sessions/{session_id}/files/content", "POST /v1/sessions/{session_id}/close"} <= routes
    assert all(e["detail"]["outcome"] == "ok" for e in api if e["detail"]["status"] < 400)

    ok = await _cli(stack, key, "audit", "verify")
    assert ok.exit_code == 0, ok.output
    export = tmp_path / "out.jsonl"
    done = await _cli(stack, key, "audit", "export", "--session", sid, "--kind", "file",
                      "--output", str(export))
    assert done.exit_code == 0, done.output
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert [x["action"] for x in lines] == ["upload", "download", "delete"]
    assert all(x["kind"] == "file" for x in lines)

    # The whole export checks out offline; an edited or a removed line is named.
    full = tmp_path / "all.jsonl"
    assert (await _cli(stack, key, "audit", "export", "-o", str(full))).exit_code == 0
    offline = await _cli(stack, key, "audit", "verify", "--file", str(full))
    assert offline.exit_code == 0 and "ok: " in offline.output, offline.output
    lines = full.read_text().splitlines()
    edited = json.loads(lines[3])
    edited["detail"]["route"] = "/v1/forged"
    (tmp_path / "edited.jsonl").write_text("\n".join([*lines[:3], json.dumps(edited), *lines[4:]]) + "\n")
    bad_file = await _cli(stack, key, "audit", "verify", "--file", str(tmp_path / "edited.jsonl"))
    assert bad_file.exit_code == 1 and f"event {edited['id']}:" in bad_file.output, bad_file.output
    (tmp_path / "cut.jsonl").write_text("\n".join([*lines[:2], *lines[3:]]) + "\n")
    cut = await _cli(stack, key, "audit", "verify", "--file", str(tmp_path / "cut.jsonl"))
    assert cut.exit_code == 1 and "event 3 is missing" in cut.output, cut.output

    # Tenant isolation: another tenant sees and verifies only its own (empty) chain.
    other = await stack.tenant_key("other")
    async with stack.client(other) as o:
        assert await _chain(o, session_id=sid) == []
        mine = await _chain(o)
        assert {e["tenant"] for e in mine} <= {"other"} and all(e["session_id"] != sid for e in mine)
        assert (await o.get("/v1/audit/verify")).json()["ok"] is True

    # Editing one row: verify fails naming that event.
    target = events[4]["id"]
    await _sql(db_url, "UPDATE audit_trail SET detail = :d WHERE tenant = 'acme' AND seq = :s",
               d=json.dumps({"forged": True}), s=target)
    bad = await _cli(stack, key, "audit", "verify")
    assert bad.exit_code != 0 and f"event {target}" in bad.output, bad.output
    async with stack.client(key) as a:
        answer = (await a.get("/v1/audit/verify")).json()
    assert answer["ok"] is False and answer["broken_id"] == target


async def test_deleting_any_row_is_named(make_stack: Callable[..., Awaitable[ApiStack]], db_url: str) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a:
        for _ in range(3):
            assert (await a.get("/v1/sessions")).status_code == 200
        first = (await a.get("/v1/audit/verify")).json()
        assert first["ok"] is True and first["head"] >= 3
        head = first["head"]
        for victim in (head, 2):  # the newest event, then one in the middle
            await _sql(db_url, "DELETE FROM audit_trail WHERE tenant = 'acme' AND seq = :s", s=victim)
            answer = (await a.get("/v1/audit/verify")).json()
            # The first missing event is named: the deleted head, then (once event 2 went too) event 2.
            assert answer["ok"] is False and answer["broken_id"] == (head if victim == head else 2), answer

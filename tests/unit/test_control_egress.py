"""Secrets, session policies and the audit endpoint through the real API stack (SQLite and PostgreSQL), with
the fake runtime. What needs namespaces and nftables (a policy actually enforced) is in
tests/integration/test_api_egress_vm.py, against a real VM."""

from __future__ import annotations

import base64
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from capsa.control.egress.service import merge_patch
from capsa.control.secretbox import SecretSealer, ensure_key_file
from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.node_egress import NodeEgress
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(120)

SECRET_VALUE = "sk-unit-" + os.urandom(12).hex()
KEY = base64.b64encode(os.urandom(32)).decode()


async def _stack(make_stack: Callable[..., Awaitable[ApiStack]], **settings: Any) -> ApiStack:
    return await make_stack(settings={"secret_key": KEY, **settings})


async def test_secrets_are_write_only_encrypted_and_tenant_scoped(
        make_stack: Callable[..., Awaitable[ApiStack]], db_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    stack = await _stack(make_stack)
    acme, other = await stack.tenant_key("acme"), await stack.tenant_key("other")
    async with stack.client(acme) as a, stack.client(other) as o:
        created = await a.post("/v1/secrets", json={"name": "openai", "value": SECRET_VALUE,
                                                   "description": "the API key"})
        assert created.status_code == 201, created.text
        body = created.json()
        assert set(body) == {"id", "name", "description", "created_at"} and body["id"].startswith("sec_")
        assert SECRET_VALUE not in created.text
        assert_problem(await a.post("/v1/secrets", json={"name": "openai", "value": "x"}), 409,
                       "already_exists")
        assert_problem(await a.post("/v1/secrets", json={"name": "empty", "value": ""}), 422,
                       "validation_error")
        assert_problem(await a.post("/v1/secrets", json={"name": "../bad", "value": "v"}), 422,
                       "validation_error")
        smuggled = await a.post("/v1/secrets", json={"name": "crlf", "value": "tok\r\nX-Evil: 1"})
        assert_problem(smuggled, 422, "validation_error")
        assert "X-Evil" not in smuggled.text  # the refusal does not echo the value
        listed = await a.get("/v1/secrets")
        assert [s["name"] for s in listed.json()["items"]] == ["openai"] and SECRET_VALUE not in listed.text
        # Another tenant neither sees nor deletes it, and may use the same name.
        assert (await o.get("/v1/secrets")).json()["items"] == []
        assert_problem(await o.delete(f"/v1/secrets/{body['id']}"), 404, "not_found")
        assert (await o.post("/v1/secrets", json={"name": "openai", "value": "v2"})).status_code == 201
        # A policy may bind only the caller's own secrets.
        policy = {"domains": [{"domain": "api.example.com"}],
                  "secrets": [{"secret": "openai", "domain": "api.example.com", "env": "KEY"}]}
        assert_problem(await o.post("/v1/sessions", json={"policy": {
            **policy, "secrets": [{"secret": body["id"], "domain": "api.example.com"}]}}), 422,
            "validation_error")

    # At rest: encrypted under the configured key, bound to tenant and id.
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT id, tenant, ciphertext FROM secrets"))).all()
    finally:
        await engine.dispose()
    sealer = SecretSealer.from_text(KEY)
    mine = next(r for r in rows if r[0] == body["id"])
    assert SECRET_VALUE.encode() not in bytes(mine[2])
    assert sealer.open("acme", body["id"], bytes(mine[2])) == SECRET_VALUE
    with pytest.raises(Exception, match="cannot be decrypted"):
        sealer.open("other", body["id"], bytes(mine[2]))
    assert SECRET_VALUE not in caplog.text

    async with stack.client(acme) as a:
        assert (await a.delete("/v1/secrets/openai")).status_code == 204
        assert (await a.get("/v1/secrets")).json()["items"] == []
        assert_problem(await a.delete("/v1/secrets/openai"), 404, "not_found")


async def test_secrets_unavailable_without_a_key(make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await make_stack()
    async with stack.client(await stack.tenant_key("acme")) as a:
        assert_problem(await a.post("/v1/secrets", json={"name": "k", "value": "v"}), 503,
                       "secrets_unavailable")


async def test_policy_validation_and_sessions_without_network(
        make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await _stack(make_stack)
    async with stack.client(await stack.tenant_key("acme")) as a:
        for bad in ({"domains": [{"domain": "10.0.0.1"}]}, {"domains": "x"}, {"nope": 1},
                    {"domains": [{"domain": "a.example.com"}],
                     "secrets": [{"secret": "k", "domain": "other.example.com"}]},
                    {"domains": [{"domain": f"d{i}.example.com"} for i in range(1001)]}):
            assert_problem(await a.post("/v1/sessions", json={"policy": bad}), 422, "validation_error")
        assert (await a.get("/v1/sessions")).json()["items"] == []  # nothing half-created
        # The fake node has no egress service: a valid policy is refused, the session does not run.
        refused = await a.post("/v1/sessions", json={"policy": {"domains": [{"domain": "a.example.com"}]}})
        assert refused.status_code == 409 and "egress" in refused.text, refused.text
        # No policy: no network; the policy cannot be added later, the audit trail is empty.
        sid = (await a.post("/v1/sessions", json={})).json()["id"]
        got = await a.get(f"/v1/sessions/{sid}/policy")
        assert got.json()["policy"] is None
        assert_problem(await a.put(f"/v1/sessions/{sid}/policy",
                                   json={"policy": {"domains": [{"domain": "a.example.com"}]}}),
                       409, "no_network")
        patched = await a.patch(f"/v1/sessions/{sid}/policy", content=b'{"domains": []}',
                                headers={"content-type": "application/merge-patch+json"})
        assert_problem(patched, 409, "no_network")  # the merge-patch body was read as JSON
        audit = await a.get(f"/v1/sessions/{sid}/audit")
        assert audit.status_code == 200 and audit.json() == {"items": [], "next_cursor": None, "dropped": 0}
        assert_problem(await a.get(f"/v1/sessions/{sid}/audit", params={"cursor": "!!"}), 422,
                       "validation_error")
        assert_problem(await a.get("/v1/sessions/ses_00000000000000000000/audit"), 404, "not_found")
    async with stack.client(await stack.tenant_key("other")) as o:
        assert_problem(await o.get(f"/v1/sessions/{sid}/audit"), 404, "not_found")
        assert_problem(await o.get(f"/v1/sessions/{sid}/policy"), 404, "not_found")


def test_merge_patch_rfc7396() -> None:
    assert merge_patch({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None, "e": 4}, "f": [1]}) == \
        {"a": 1, "b": {"d": 3, "e": 4}, "f": [1]}
    assert merge_patch({"a": 1}, [1]) == [1]


def test_audit_log_cursor_epoch_and_loss() -> None:
    log = AuditLog(capacity=3)
    for i in range(5):
        log(EgressEvent(kind="dns", sandbox_id="sbx_x", destination=f"n{i}", decision="deny"))
    page = log.read(0, log.epoch, 10)
    assert [s for s, _ in page.events] == [3, 4, 5] and page.lost == 2 and page.last_seq == 5
    # ``lost`` counts, for the epoch, the events that left before any reader had them.
    assert log.read(4, log.epoch, 10).events[0][0] == 5 and log.read(4, log.epoch, 10).lost == 2
    # A cursor from another node process starts over.
    assert [s for s, _ in log.read(4, "stale", 10).events] == [3, 4, 5]


def test_key_file_is_private_and_kept(tmp_path: Any) -> None:
    path = ensure_key_file(tmp_path / "secret.key")
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    SecretSealer.from_text(first)
    assert ensure_key_file(path).read_text() == first


def _node_egress() -> NodeEgress:
    # Only its audit log is used here; a private namespace prefix keeps its start-up cleanup away from
    # every other test's namespaces.
    return NodeEgress.create(netns_prefix=f"cue{secrets.token_hex(3)}-")


async def test_audit_is_collected_by_heartbeats_once_per_event_and_across_node_restarts(
        make_stack: Callable[..., Awaitable[ApiStack]], db_url: str) -> None:
    node_egress = _node_egress()
    stack = await make_stack(settings={"secret_key": KEY}, egress=node_egress)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as a:
        sid = (await a.post("/v1/sessions", json={})).json()["id"]
        assert stack.agent is not None
        (record,) = stack.agent.list()
        for i in range(3):
            node_egress.audit(EgressEvent(kind="dns", session_id=sid, sandbox_id=record.id,
                                          destination=f"q{i}.test", decision="deny"))
        node_egress.audit(EgressEvent(kind="dns", session_id="ses_unknownunknownunkn", sandbox_id="sbx_x",
                                      destination="stray.test", decision="deny"))
        assert (await stack.heartbeat()).status_code == 200
        assert (await stack.heartbeat()).status_code == 200  # nothing new: no duplicates

        engine = create_async_engine(db_url)
        try:
            async with engine.connect() as conn:
                rows = (await conn.execute(text(
                    "SELECT tenant, destination FROM audit_events ORDER BY id"))).all()
        finally:
            await engine.dispose()
        # The stray event names a session not placed on this node: it is not filed at all.
        assert [(t, d) for t, d in rows] == [("acme", "q0.test"), ("acme", "q1.test"), ("acme", "q2.test")]

        # A new node process starts numbering again: its events are new, not skipped.
        node_egress.audit = AuditLog()
        node_egress.service.broker.sink = node_egress.audit
        node_egress.audit(EgressEvent(kind="http", session_id=sid, sandbox_id=record.id, method="GET",
                                      destination="api.test", status=200, decision="allow",
                                      secret_ids=["sec_aaaaaaaaaaaaaaaaaaaa"]))
        page = await a.get(f"/v1/sessions/{sid}/audit", params={"limit": 2})
        assert [e["destination"] for e in page.json()["items"]] == ["q0.test", "q1.test"]
        rest = await a.get(f"/v1/sessions/{sid}/audit", params={"cursor": page.json()["next_cursor"]})
        items = rest.json()["items"]
        assert [e["destination"] for e in items] == ["q2.test", "api.test"]
        assert items[-1]["secret_ids"] == ["sec_aaaaaaaaaaaaaaaaaaaa"] and items[-1]["status"] == 200
        allowed = await a.get(f"/v1/sessions/{sid}/audit", params={"decision": "allow"})
        assert [e["destination"] for e in allowed.json()["items"]] == ["api.test"]
    async with stack.client(await stack.tenant_key("other")) as o:
        assert_problem(await o.get(f"/v1/sessions/{sid}/audit"), 404, "not_found")

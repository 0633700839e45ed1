"""Networked sessions through the whole server side (fake runtime guests, real namespaces and broker): the
control plane records a session's placeholders and sends them, with its current policy and secrets, to every
start of its sandboxes, so pause -> resume keeps the placeholder the guest holds; a policy changed while
paused applies on resume; branches get a copy of the parent's policy and placeholders, each under its own
session (audit identity); closing everything leaves no namespace behind."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
from collections.abc import Awaitable, Callable

import httpx
import pytest

from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.trust_store import TrustStore
from tests.support.api_stack import ApiStack

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, nftables and confined guests"),
]

KEY = base64.b64encode(os.urandom(32)).decode()
TRUST = TrustStore(bundle="/tmp/capsa-trust/ca-certificates.crt", ca_file="/tmp/capsa-trust/capsa-egress.crt")


def _netns(prefix: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip() and line.startswith(prefix)}


async def _env(c: httpx.AsyncClient, sid: str, name: str) -> str:
    run = await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["printenv", name]})
    assert run.status_code == 200, run.text
    return str(run.json()["stdout"]).strip()


def _broker_session(egress: NodeEgress, stack: ApiStack, session_id: str) -> tuple[str, list[str]]:
    """(sandbox id, allowed domains) of the session's sandbox, as the node's broker has it."""
    assert stack.agent is not None
    for record in stack.agent.list():
        state = egress.service.broker.get(record.id)
        if state.session_id == session_id:
            return record.id, [r.domain for r in state.policy.domains]
    raise AssertionError(f"no sandbox of {session_id} on the broker")


async def test_networked_session_keeps_its_placeholder_across_pause_resume_and_branches(
        make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    prefix = f"cnc{secrets.token_hex(3)}-"
    egress = NodeEgress.create(netns_prefix=prefix)
    stack = await make_stack(settings={"secret_key": KEY}, egress=egress, trust=TRUST)
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("other")
    async with stack.client(key) as a, stack.client(other) as o:
        assert (await a.post("/v1/secrets", json={"name": "api", "value": "the-value"})).status_code == 201
        policy = {"domains": [{"domain": "api.example.test"}],
                  "secrets": [{"secret": "api", "domain": "api.example.test", "env": "API_KEY"}]}
        created = await a.post("/v1/sessions", json={"policy": policy})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        placeholder = await _env(a, sid, "API_KEY")
        assert placeholder.startswith("capsa_ph_") and "the-value" not in placeholder
        first_sandbox, _ = _broker_session(egress, stack, sid)

        assert (await a.post(f"/v1/sessions/{sid}/pause")).json()["state"] == "paused"
        assert _netns(prefix) == set()  # the paused session holds no network on the node
        # Changed while paused: only the record changes, the resume starts under it.
        patched = await a.patch(f"/v1/sessions/{sid}/policy", content=b'{"domains": [{"domain": '
                                b'"api.example.test"}, {"domain": "b.example.test"}]}',
                                headers={"Content-Type": "application/merge-patch+json"})
        assert patched.status_code == 200, patched.text
        resumed = await a.post(f"/v1/sessions/{sid}/resume")
        assert resumed.status_code == 200, resumed.text
        assert await _env(a, sid, "API_KEY") == placeholder
        sandbox, domains = _broker_session(egress, stack, sid)
        assert sandbox != first_sandbox and domains == ["api.example.test", "b.example.test"]
        state = egress.service.broker.get(sandbox)
        assert state.placeholders[placeholder].domain == "api.example.test"
        assert len(_netns(prefix)) == 1

        branched = await a.post(f"/v1/sessions/{sid}/branch", json={"n": 3})
        assert branched.status_code == 201, branched.text
        children = [item["id"] for item in branched.json()["items"]]
        assert len(_netns(prefix)) == 4
        for child in children:
            # The parent's placeholder, copied into the branch's memory, works in the branch's session.
            assert await _env(a, child, "API_KEY") == placeholder
            child_sandbox, child_domains = _broker_session(egress, stack, child)
            binding = egress.service.broker.get(child_sandbox).placeholders[placeholder]
            assert binding.secret.startswith("sec_") and binding.domain == "api.example.test"
            assert child_domains == domains
            assert (await a.get(f"/v1/sessions/{child}/policy")).json()["policy"]["domains"] == \
                [{"domain": "api.example.test"}, {"domain": "b.example.test"}]
            assert (await o.get(f"/v1/sessions/{child}/policy")).status_code == 404
        # A branch's policy is its own: dropping the binding there leaves the others' placeholder working.
        put = await a.put(f"/v1/sessions/{children[0]}/policy", json={"policy": {
            "domains": [{"domain": "api.example.test"}]}})
        assert put.status_code == 200, put.text
        broker = egress.service.broker
        assert broker.get(_broker_session(egress, stack, children[0])[0]).placeholders == {}
        assert placeholder in broker.get(_broker_session(egress, stack, children[1])[0]).placeholders

        for s in [sid, *children]:
            assert (await a.post(f"/v1/sessions/{s}/close")).status_code == 200
    assert _netns(prefix) == set() and egress.store.ids() == []

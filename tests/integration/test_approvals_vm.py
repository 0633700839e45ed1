"""Approvals end to end with a real microVM behind the real API stack: a POST made inside the VM over HTTPS is
held by the node's broker, listed through ``/v1/approvals``, and approved (the VM gets the upstream's
answer), denied or left to time out (the VM gets a 403 naming the approval); the session's audit trail names
the API key that decided. The upstream lives in a namespace this test creates (tests.support.outside)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.egress.audit_log import AuditLog
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.qemu import QemuRuntime
from tests.support.api_stack import ApiStack
from tests.support.outside import outside_world
from tests.support.resolvers import DnsResolver

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

POLICY = {"domains": [{"domain": "api.allowed.test", "approvals": [
    {"name": "charges", "methods": ["POST"], "path_prefixes": ["/v1/charges"], "timeout_s": 120},
    {"name": "quick", "methods": ["POST"], "path_prefixes": ["/v1/quick"], "timeout_s": 3},
]}]}

# Inside the VM: one HTTPS POST (transparent TLS to the broker, the sandbox CA in the system trust store).
POST = r'''
import json, ssl, sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                     urllib.request.HTTPSHandler(context=ssl.create_default_context()))
req = urllib.request.Request("https://api.allowed.test" + sys.argv[1], data=sys.argv[2].encode(),
                             method="POST", headers={"Content-Type": "application/json"})
try:
    with opener.open(req, timeout=200) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
'''


async def _post_in_vm(api: httpx.AsyncClient, sid: str, path: str, body: str) -> dict[str, Any]:
    response = await api.post(f"/v1/sessions/{sid}/commands",
                              json={"cmd": ["python3", "-c", POST, path, body], "timeout": 300}, timeout=360)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["exit_code"] == 0, result["stderr"]
    out: dict[str, Any] = json.loads(result["stdout"])
    return out


async def _pending(api: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    for _ in range(600):
        page = await api.get("/v1/approvals", params={"session_id": sid})
        items: list[dict[str, Any]] = page.json()["items"]
        if items:
            return items[0]
        await asyncio.sleep(0.25)
    raise AssertionError("the VM's request was never held")


async def test_approvals_with_a_real_vm(guest_image: GuestImage, state_dir: Path) -> None:
    octet = 150 + secrets.randbelow(40)
    async with outside_world(octet) as world:
        audit = AuditLog()
        store = InMemorySecretStore(SecretBox(os.urandom(32)))
        broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                              upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                              allow_networks=[world.net])
        manager = NetworkManager(netns_prefix=f"cav{secrets.token_hex(3)}-")
        egress = NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)
        runtime = QemuRuntime(Settings(state_dir=state_dir), accel="auto", accel_cache=False)
        stack = ApiStack(f"sqlite+aiosqlite:///{state_dir}/capsa.db", runtime, guest_image,  # type: ignore[arg-type]
                         settings={"reaper_interval": 0}, egress=egress)
        async with stack:
            key = await stack.tenant_key("acme")
            key_id = key.rsplit("_", 1)[0]
            async with stack.client(key) as api:
                created = await api.post("/v1/sessions", json={"policy": POLICY})
                assert created.status_code == 201, created.text
                sid = created.json()["id"]

                # Approved: the VM gets the upstream's answer (a JSON echo of what it received).
                call = asyncio.create_task(_post_in_vm(api, sid, "/v1/charges", '{"amount": 4200}'))
                held = await _pending(api, sid)
                assert (held["method"], held["destination"], held["path"], held["preview"]) == (
                    "POST", "api.allowed.test", "/v1/charges", '{"amount": 4200}')
                assert not call.done()
                approved = await api.post(f"/v1/approvals/{held['id']}/approve", json={"reason": "fine"})
                assert approved.status_code == 200, approved.text
                answer = await call
                assert answer["status"] == 200
                echoed = json.loads(answer["body"])
                assert (echoed["method"], echoed["path"], echoed["body"], echoed["tls"]) == (
                    "POST", "/v1/charges", '{"amount": 4200}', True)

                # Denied: a 403 naming the approval.
                call = asyncio.create_task(_post_in_vm(api, sid, "/v1/charges/2", "{}"))
                second = await _pending(api, sid)
                assert (await api.post(f"/v1/approvals/{second['id']}/deny",
                                       json={"reason": "no"})).status_code == 200
                answer = await call
                assert answer["status"] == 403
                assert json.loads(answer["body"])["error"] == "approval_denied"
                assert json.loads(answer["body"])["approval_id"] == second["id"]

                # Timed out: a 403 too.
                answer = await _post_in_vm(api, sid, "/v1/quick", "{}")
                assert answer["status"] == 403 and json.loads(answer["body"])["error"] == "approval_timeout"
                timed_id = json.loads(answer["body"])["approval_id"]

                trail = (await api.get(f"/v1/sessions/{sid}/audit", params={"limit": 1000})).json()["items"]
                reasons = [e["reason"] for e in trail if e["kind"] == "approval"]
                assert f"approval {held['id']} approved by {key_id} (scope once): fine" in reasons
                assert f"approval {second['id']} denied by {key_id} (scope once): no" in reasons
                assert f"approval {timed_id} timed out" in reasons
                assert (await api.post(f"/v1/sessions/{sid}/close")).status_code == 200

                # One linked chain: create -> commands -> egress -> approvals -> close, each event of the
                # session, the decisions naming who decided, and the tenant's chain intact.
                chain = (await api.get("/v1/audit", params={"session_id": sid, "limit": 1000})
                         ).json()["items"]
                kinds = [e["kind"] for e in chain]
                assert {"api", "session", "command", "egress", "approval"} <= set(kinds), kinds
                assert all(e["session_id"] == sid for e in chain)
                actions = [(e["kind"], e["action"]) for e in chain]
                assert actions.index(("session", "create")) < actions.index(("approval", "approved")) \
                    < actions.index(("session", "close")), actions
                decided = [e for e in chain
                           if e["kind"] == "approval" and e["action"] in ("approved", "denied")]
                # A node event's own facts are under detail.detail (beside its egress fields).
                assert {e["detail"]["detail"].get("decided_by") for e in decided} == {key_id}, decided
                verified = (await api.get("/v1/audit/verify")).json()
                assert verified["ok"] and verified["checked"] == verified["head"] > len(chain), verified

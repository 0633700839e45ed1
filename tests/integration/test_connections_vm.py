"""A connection end to end with a real microVM: a local OAuth 2.0 server (authlib's server side) in a
test-made namespace, a person's sign-in through capsa (the test plays the browser and follows the
authorization URL to capsa's callback), a sandbox calling the protected API with the token the broker
injects, the token refreshed when it expires (20 concurrent requests, one refresh counted by the server),
revocation stopping the next request, and none of the access tokens, refresh tokens or the client secret
in the guest's environment, disk or memory."""

from __future__ import annotations

import asyncio
import base64
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
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from tests.support.api_stack import ApiStack
from tests.support.oauth_server import CLIENT_ID, CLIENT_SECRET, oauth_world
from tests.support.resolvers import DnsResolver
from tests.support.scan import file_contains, memory_contains

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

LIFETIME = 40
"""Seconds an access token lives: long enough for one call from the VM, short enough to wait out."""

# Inside the VM (stdlib only): N requests to the protected API released at once; status and body of each.
CALLS = r'''
import json, sys, threading, urllib.error, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
gate, out = threading.Barrier(n), [None] * n
def call(i):
    gate.wait()
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            out[i] = [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        out[i] = [e.code, e.read().decode()[:200]]
    except Exception as e:
        out[i] = [0, repr(e)]
threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(out))
'''


async def _calls(api: httpx.AsyncClient, sid: str, url: str, n: int) -> list[list[Any]]:
    response = await api.post(f"/v1/sessions/{sid}/commands", timeout=400,
                              json={"cmd": ["python3", "-c", CALLS, url, str(n)], "timeout": 300})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["exit_code"] == 0, result["stderr"]
    calls: list[list[Any]] = json.loads(result["stdout"])
    return calls


async def test_connection_sign_in_injection_refresh_and_revocation_with_a_real_vm(
        guest_image: GuestImage, state_dir: Path) -> None:
    octet = 150 + secrets.randbelow(40)
    async with oauth_world(octet, expires_in=LIFETIME) as world:
        lab = world.lab
        audit = AuditLog()
        store = InMemorySecretStore(SecretBox(os.urandom(32)))
        broker = EgressBroker(secrets=store, sink=audit, resolver=DnsResolver(world.ip),
                              upstream_ssl=ssl.create_default_context(cafile=str(world.ca_file)),
                              allow_networks=[world.net], tokens=ConnectionTokens())
        manager = NetworkManager(netns_prefix=f"cco{secrets.token_hex(3)}-")
        egress = NodeEgress(EgressService(manager, broker, audit, poll_interval=0.5), store, audit)
        runtime = QemuRuntime(Settings(state_dir=state_dir), accel="auto", accel_cache=False)
        stack = ApiStack(f"sqlite+aiosqlite:///{state_dir}/capsa.db", runtime, guest_image,  # type: ignore[arg-type]
                         settings={"secret_key": base64.b64encode(os.urandom(32)).decode(),
                                   "reaper_interval": 0, "oauth_ca_file": str(world.ca_file),
                                   "oauth_allow_networks": [str(world.net)]},
                         egress=egress)
        async with stack, stack.client(await stack.tenant_key("acme")) as api:
            # The tenant registers the provider by discovery and adds a connection; a person signs in.
            provider = await api.post("/v1/connection-providers", json={
                "name": "lab", "issuer": world.issuer, "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET, "scopes": ["read"]})
            assert provider.status_code == 201, provider.text
            assert (await api.post("/v1/connections", json={"name": "lab", "provider": "lab"})
                    ).status_code == 201
            login = await api.post("/v1/connections/lab/login", json={"mode": "code"})
            assert login.status_code == 200, login.text
            lab_ca = ssl.create_default_context(cafile=str(world.ca_file))
            async with httpx.AsyncClient(verify=lab_ca) as browser:
                redirect = await browser.get(login.json()["authorization_url"])
                assert redirect.status_code == 302
                done = await browser.get(redirect.headers["location"])
                assert done.status_code == 200, done.text
            assert lab.issued == 1

            policy = {"domains": [{"domain": world.api_name}],
                      "connections": [{"connection": "lab", "domains": [world.api_name]}]}
            session = await api.post("/v1/sessions", json={"policy": policy})
            assert session.status_code == 201, session.text
            sid = session.json()["id"]
            url = f"https://{world.api_name}/api/whoami"

            # 1. The sandbox calls the protected API; the broker adds the token it never sees.
            [[status, body]] = await _calls(api, sid, url, 1)
            assert status == 200 and json.loads(body)["user"] == "alice", body

            # 2. Once the token is due, 20 concurrent requests: one refresh at the provider.
            await asyncio.sleep(LIFETIME * 3 / 4 + 1)  # the token the first call used is due now
            before = lab.refreshes
            lab.refresh_delay = 1.0
            calls = await _calls(api, sid, url, 20)
            assert [c[0] for c in calls] == [200] * 20, calls
            assert lab.refreshes == before + 1, (before, lab.refreshes)
            conn = (await api.get("/v1/connections/lab")).json()
            assert conn["refreshes"] == lab.refreshes

            # 3. No credential anywhere in the guest: environment, disk, memory.
            dump = await api.post(f"/v1/sessions/{sid}/commands", json={
                "cmd": ["sh", "-c", "cat /proc/*/environ 2>/dev/null; env; sync"]})
            assert dump.status_code == 200
            assert stack.agent is not None
            (record,) = stack.agent.list()
            vm = record.sandbox
            assert isinstance(vm, QemuSandbox) and vm.pid is not None
            credentials = lab.all_secrets()
            assert len(credentials) >= 5  # client secret, two access and two refresh tokens at least
            for credential in credentials:
                assert credential not in dump.text
                assert not await asyncio.to_thread(memory_contains, vm.pid, credential.encode())
                assert not await asyncio.to_thread(file_contains, vm.workdir / "disk.img",
                                                   credential.encode())

            # 4. Revocation stops the next request, on the node, at once.
            revoked = await api.post("/v1/connections/lab/revoke")
            assert revoked.status_code == 200, revoked.text
            assert revoked.json()["nodes_notified"] == [stack.node_id]
            assert revoked.json()["provider_revoked"] is True
            served = lab.api_calls
            [[status, body]] = await _calls(api, sid, url, 1)
            assert status == 403 and "revoked" in body, body
            assert lab.api_calls == served  # it never reached the API

            events = (await api.get(f"/v1/sessions/{sid}/audit", params={"limit": 1000})).json()["items"]
            kinds = [e for e in events if e["kind"] == "connection"]
            assert any(e["decision"] == "deny" and "revoked" in (e["reason"] or "") for e in kinds)
            assert sum("injected" in (e["reason"] or "") for e in kinds) == 21
            for credential in credentials:
                assert credential not in json.dumps(events)
            assert (await api.delete(f"/v1/sessions/{sid}")).status_code in (200, 204)

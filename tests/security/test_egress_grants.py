"""Egress grants through the real control plane and node agent (fake runtime, real namespaces and broker;
SQLite and PostgreSQL): only an admin key grants or revokes a tenant's internal networks, each change is in
the granted tenant's audit chain, a policy naming a host that resolves into the operator's internal networks
(``CAPSA_EGRESS_ALLOW_NETWORKS``) is refused at set time for a tenant without a grant (create and update),
and the grant reaches the node's broker with the session's sandbox, and is taken back from it at once on
revocation. ``mirror.corp`` plays the internal host: the control plane's lookups answer it with 127.0.0.1
(a table in place of the host's DNS, as the broker tests use StaticResolver)."""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable

import pytest

from capsa.control.egress import grants as egress_grants
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.trust_store import TrustStore
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem

pytestmark = [pytest.mark.timeout(180), pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="sandbox namespaces need root")]

INTERNAL = {"domains": [{"domain": "mirror.corp"}, {"domain": "*.example.com"}]}


async def _table(host: str) -> list[str]:
    return {"mirror.corp": ["127.0.0.1"], "api.example.com": ["93.184.215.14"]}.get(host, [])


# The fake runtime's guests are host processes: their CA goes to a scratch bundle, not the host's.
TRUST = TrustStore(bundle="/tmp/capsa-trust/ca-certificates.crt", ca_file="/tmp/capsa-trust/capsa-egress.crt")
PUBLIC = {"domains": [{"domain": "api.example.com"}]}


async def test_grants_are_admin_only_audited_checked_at_set_time_and_pushed(
        make_stack: Callable[..., Awaitable[ApiStack]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_EGRESS_ALLOW_NETWORKS", "127.0.0.0/8")
    monkeypatch.setattr(egress_grants, "_addresses", _table)
    node_egress = NodeEgress.create(netns_prefix=f"cgr{secrets.token_hex(3)}-",
                                    internal_networks=[ipaddress.ip_network("127.0.0.0/8")])
    stack = await make_stack(egress=node_egress, trust=TRUST)
    admin, acme, other = (await stack.tenant_key("ops", admin=True), await stack.tenant_key("acme"),
                          await stack.tenant_key("other"))
    broker = node_egress.service.broker
    async with stack.client(admin) as ad, stack.client(acme) as a, stack.client(other) as o:
        # Without a grant: refused when the policy is set, with the reason.
        refused = await a.post("/v1/sessions", json={"policy": INTERNAL})
        assert_problem(refused, 422, "egress_network_not_granted")
        assert "mirror.corp resolves to 127.0.0.1" in refused.text
        assert "POST /v1/egress-grants" in refused.text
        plain = await a.post("/v1/sessions", json={"policy": PUBLIC})
        assert plain.status_code == 201, plain.text
        sid_plain = plain.json()["id"]
        assert_problem(await a.put(f"/v1/sessions/{sid_plain}/policy", json={"policy": INTERNAL}), 422,
                       "egress_network_not_granted")

        # Only an admin grants.
        grant = {"tenant": "acme", "network": "127.0.0.0/8", "note": "package mirror"}
        assert_problem(await a.post("/v1/egress-grants", json=grant), 403, "forbidden")
        assert_problem(await a.get("/v1/egress-grants"), 403, "forbidden")
        assert_problem(await ad.post("/v1/egress-grants", json={**grant, "network": "127.0.0.1/8"}), 422,
                       "validation_error")  # host bits set: refused, not widened
        made = await ad.post("/v1/egress-grants", json=grant)
        assert made.status_code == 201, made.text
        assert made.json()["created_by"] == admin.rsplit("_", 1)[0]
        assert_problem(await ad.post("/v1/egress-grants", json=grant), 409, "already_exists")
        listed = (await ad.get("/v1/egress-grants", params={"tenant": "acme"})).json()["items"]
        assert [(g["tenant"], g["network"]) for g in listed] == [("acme", "127.0.0.0/8")]

        # The running session got the grant at once; a new one starts with it; the other tenant does not.
        running = next(s for s in broker._sandboxes.values() if s.session_id == sid_plain)
        assert [str(n) for n in running.granted] == ["127.0.0.0/8"]
        created = await a.post("/v1/sessions", json={"policy": INTERNAL})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        sbx = next(s for s in broker._sandboxes.values() if s.session_id == sid)
        assert [str(n) for n in sbx.granted] == ["127.0.0.0/8"]
        assert (await a.put(f"/v1/sessions/{sid_plain}/policy", json={"policy": INTERNAL})).status_code == 200
        assert_problem(await o.post("/v1/sessions", json={"policy": INTERNAL}), 422,
                       "egress_network_not_granted")

        # Revoked: every running sandbox of the tenant loses it at once.
        revoked = await ad.delete("/v1/egress-grants", params={"tenant": "acme", "network": "127.0.0.0/8"})
        assert revoked.status_code == 200, revoked.text
        assert sbx.granted == () and running.granted == ()
        gone = {"tenant": "acme", "network": "127.0.0.0/8"}
        assert_problem(await ad.delete("/v1/egress-grants", params=gone), 404, "not_found")

        # Both changes are in acme's chain (the tenant sees who granted what), not in other's.
        chain = (await a.get("/v1/audit", params={"limit": 1000})).json()["items"]
        changes = [(e["action"], e["detail"]["network"]) for e in chain if e["kind"] == "egress"
                   and e["action"] in ("network_granted", "network_revoked")]
        assert changes == [("network_granted", "127.0.0.0/8"), ("network_revoked", "127.0.0.0/8")]
        theirs = (await o.get("/v1/audit", params={"limit": 1000})).json()["items"]
        assert not [e for e in theirs if e["action"] in ("network_granted", "network_revoked")]
        for s in (sid, sid_plain):
            assert (await a.delete(f"/v1/sessions/{s}")).status_code in (200, 204)

"""Controlled egress exceptions through a real ``capsa serve`` and a VM (issue 27): an internal upstream in a
namespace this test creates (tests.support.outside, 10.250.<n>.0/24) is opened by
``CAPSA_EGRESS_ALLOW_NETWORKS`` and reached through ``CAPSA_EGRESS_UPSTREAM_PROXY``, a real CONNECT proxy
(tests.support.connect_proxy) running inside that namespace with credentials.

- without a grant the internal upstream is refused: at policy set time for an exact name (422), at connect
  time for a wildcard the control plane cannot check (403 from the broker), and the proxy hears nothing;
- an admin grants the tenant the network: its running VM reaches the upstream over HTTP and HTTPS, each
  through one CONNECT to the pinned address in the proxy's log; the node's own address in that network
  stays refused; another tenant is still refused, before the proxy;
- the proxy's password is in no log of ``capsa serve`` and nowhere in the VM.

``capsa serve`` runs in a private mount namespace whose /etc/hosts names the upstream (the host's own file
is untouched), and trusts the upstream's CA through ``SSL_CERT_FILE``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from capsa.sdk import Session
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.outside import World, outside_world
from tests.support.served import ROOT, start_serve

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.geteuid() != 0, reason="capsa serve needs root for sandbox namespaces"),
]

PASSWORD = "prx-" + secrets.token_hex(12)
WILDCARD = {"domains": [{"domain": "*.allowed.test"}]}

PROBE = r'''
import json, sys, urllib.error, urllib.request
out = {}
for name, url in (("http", "http://mirror.allowed.test/v1/x"), ("https", "https://mirror.allowed.test/v1/x"),
                  ("node", "http://node.allowed.test/v1/x"), ("evil", "http://evil.test/")):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            out[name] = [r.status, r.read(300).decode(errors="replace")]
    except urllib.error.HTTPError as e:
        out[name] = [e.code, e.read(300).decode(errors="replace")]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)[:200]]
print(json.dumps(out))
'''


def _probe(s: Session) -> dict[str, list[object]]:
    result = s.commands.run(["python3", "-c", PROBE], timeout=300)
    assert result.exit_code == 0, result.stderr
    out: dict[str, list[object]] = json.loads(result.stdout)
    return out


def _tunnels(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_internal_upstream_by_grant_through_the_upstream_proxy(workdir: Path) -> None:
    octet = 200 + secrets.randbelow(50)
    async with outside_world(octet) as world:
        # The world's servers run on this event loop: the blocking SDK calls go to a thread.
        await asyncio.to_thread(_scenario, world, octet, workdir)


def _scenario(world: World, octet: int, workdir: Path) -> None:
    up_ip, node_ip, proxy_ip = world.ip, f"10.250.{octet}.1", f"10.250.{octet}.4"
    links = subprocess.run(["ip", "-n", world.ns, "-o", "link", "show", "type", "veth"], check=True,
                           capture_output=True, text=True).stdout
    veth = links.split(":")[1].strip().split("@")[0]
    subprocess.run(["ip", "-n", world.ns, "addr", "add", f"{proxy_ip}/24", "dev", veth], check=True)
    log = workdir / "proxy.jsonl"
    proxy = subprocess.Popen(
        ["ip", "netns", "exec", world.ns, sys.executable, "-m", "tests.support.connect_proxy",
         "--host", proxy_ip, "--port", "3128", "--log", str(log), "--auth", f"capsa:{PASSWORD}"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
        hosts = workdir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{up_ip} mirror.allowed.test\n{node_ip} node.allowed.test\n")
        state = workdir / "state"
        served = start_serve(state, workdir, env={
            "CAPSA_BOOTSTRAP_KEY": "", "SSL_CERT_FILE": str(world.ca_file),
            "CAPSA_EGRESS_ALLOW_NETWORKS": world.net,
            "CAPSA_EGRESS_UPSTREAM_PROXY": f"http://capsa:{PASSWORD}@{proxy_ip}:3128"},
            prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)])
        try:
            admin = served.bootstrap_key()
            keys: dict[str, str] = {}
            with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {admin}"}) as api:
                for tenant in ("acme", "other"):
                    made = api.post("/v1/keys", json={"tenant": tenant})
                    assert made.status_code == 201, made.text
                    keys[tenant] = made.json()["key"]
                with httpx.Client(base_url=served.url,
                                  headers={"authorization": f"Bearer {keys['acme']}"}) as acme:
                    exact = acme.post("/v1/sessions",
                                      json={"policy": {"domains": [{"domain": "mirror.allowed.test"}]}})
                    assert exact.status_code == 422, exact.text
                    assert exact.json()["code"] == "egress_network_not_granted", exact.text
                with Session.create(policy=WILDCARD, api_url=served.url, api_key=keys["acme"]) as s:
                    before = _probe(s)
                    statuses = [before[k][0] for k in ("http", "https", "node", "evil")]
                    assert statuses == [403, 403, 403, 403], before
                    assert "not granted" in str(before["http"][1])
                    assert _tunnels(log) == []  # refused before the proxy was contacted

                    granted = api.post("/v1/egress-grants", json={"tenant": "acme", "network": world.net})
                    assert granted.status_code == 201, granted.text
                    after = _probe(s)
                    assert after["http"][0] == 200 and after["https"][0] == 200, after
                    assert after["node"][0] == 403 and after["evil"][0] == 403, after
                    seen = [(t["target"], t["status"]) for t in _tunnels(log)]
                    assert seen == [(f"{up_ip}:80", 200), (f"{up_ip}:443", 200)], seen
                    env = s.commands.run(["sh", "-c", "env; cat /proc/*/environ 2>/dev/null"])
                    assert PASSWORD not in env.stdout
                    chain = httpx.get(f"{served.url}/v1/audit", params={"limit": 1000},
                                      headers={"authorization": f"Bearer {keys['acme']}"}).json()["items"]
                    assert any(e["action"] == "network_granted" for e in chain)
                with Session.create(policy=WILDCARD, api_url=served.url, api_key=keys["other"]) as o:
                    theirs = _probe(o)
                    assert theirs["http"][0] == 403 and theirs["https"][0] == 403, theirs
                    assert len(_tunnels(log)) == 2
        finally:
            assert served.stop() == 0, served.errors()
        logs = served.stdout.read_text() + served.stderr.read_text()
        assert PASSWORD not in logs
        assert wait_no_vm_leftovers(state) == []
    finally:
        proxy.terminate()
        proxy.wait(10)

"""Egress through a real ``capsa serve`` (its own NodeEgress, QemuRuntime on the storage pool, key file) and
the CLI/SDK:
a secret stored with ``capsa secrets create`` reaches a session with a policy only as a placeholder, the
sandbox CA is in the guest's system bundle, requests and DNS queries show up in ``capsa audit``, and closing
the session leaves no namespace behind. The node resolves with the host's resolver and refuses private
answers, so nothing here reaches any network: the requests the sandbox makes are refused or fail at the
node, which is what the audit trail must show."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from capsa.sdk import Session
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.served import KEY_RE, capsa, start_serve

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="capsa serve needs root for sandbox namespaces"),
]

SECRET = "sk-serve-" + secrets.token_hex(16)

PROBE = r'''
import json, os, socket, urllib.request, urllib.error
out = {"placeholder": os.environ.get("API_KEY", ""), "proxy": os.environ.get("HTTPS_PROXY", "")}
bundle = open("/etc/ssl/certs/ca-certificates.crt").read()
ca = open("/usr/local/share/ca-certificates/capsa-egress.crt").read()
out["ca_in_bundle"] = ca.strip() in bundle
try:
    socket.gethostbyname("evil.test")
    out["evil"] = "resolved"
except OSError as e:
    out["evil"] = "refused"
try:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open("http://api.allowed.test/v1/x", timeout=30) as r:
        out["allowed"] = r.status
except urllib.error.HTTPError as e:
    out["allowed"] = e.code
except Exception as e:
    out["allowed"] = type(e).__name__
print(json.dumps(out))
'''


def test_serve_policy_secret_audit_and_teardown(workdir: Path) -> None:
    state = workdir / "state"
    served = start_serve(state, workdir, env={"CAPSA_BOOTSTRAP_KEY": ""})
    try:
        match = KEY_RE.search(served.printed())
        assert match, served.printed()
        key = match.group(1)
        key_file = state.resolve() / "secret.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        created = capsa(served, key, "secrets", "create", "upstream", stdin=SECRET + "\n")
        assert created.returncode == 0, created.stderr
        secret_id = created.stdout.strip()
        policy = {"domains": [{"domain": "api.allowed.test"}],
                  "secrets": [{"secret": "upstream", "domain": "api.allowed.test", "env": "API_KEY"}]}
        prefix = "cs" + hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:8] + "-"
        with Session.create(policy=policy, api_url=served.url, api_key=key) as s:
            assert s.egress.policy().policy["secrets"][0]["secret"] == secret_id  # type: ignore[index]
            netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert prefix in netns
            result = s.commands.run(["python3", "-c", PROBE], timeout=120)
            assert result.exit_code == 0, result.stderr
            seen = json.loads(result.stdout)
            assert seen["placeholder"].startswith("capsa_ph_") and SECRET not in result.stdout
            assert seen["proxy"].startswith("http://") and seen["ca_in_bundle"] is True
            assert seen["evil"] == "refused"
            assert seen["allowed"] not in (200, "URLError")  # resolved by the stub, refused at the node
            env = s.commands.run(["sh", "-c", "cat /proc/*/environ 2>/dev/null; env"])
            assert SECRET not in env.stdout
            events = s.audit()
            assert any(e.kind == "dns" and e.destination == "evil.test" and e.decision == "deny"
                       for e in events), events
            assert any(e.kind == "http" and e.destination == "api.allowed.test" and e.decision != "allow"
                       for e in events), events
            sid = s.id
        cli = capsa(served, key, "audit", sid, "--json")
        assert cli.returncode == 0, cli.stderr
        items = json.loads(cli.stdout)["items"]
        assert len(items) >= len(events) and SECRET not in cli.stdout
        table = capsa(served, key, "audit", sid, "--decision", "deny")
        assert "evil.test" in table.stdout
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert prefix not in netns
        assert SECRET.encode() not in (state / "capsa.db").read_bytes()
    finally:
        assert served.stop() == 0, served.stderr.read_text()[-3000:]
        assert wait_no_vm_leftovers(state) == []

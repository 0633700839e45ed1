"""A real microVM behind its sandbox namespace, talking to an "external API" through the egress broker:
the secret is injected on the way out, redacted on the way back, and no byte of it is in the VM's
environment, disk or memory. Every address used lives in namespaces this test creates."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.egress.audit import ListSink
from capsa.node.egress.service import EgressService
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime
from tests.support.outside import SECRET, SECRET_ID, outside_world, world_policy
from tests.support.scan import file_contains, memory_contains

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and nftables"),
]

CA_PATH = "/usr/local/share/ca-certificates/capsa-egress.crt"

GUEST_CLIENT = r"""
import json, os, ssl, sys, urllib.error, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[1])
def get(url, headers, proxy):
    handlers = [urllib.request.ProxyHandler({} if not proxy else {"https": proxy, "http": proxy}),
                urllib.request.HTTPSHandler(context=ctx)]
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:
        return 0, type(e).__name__ + ": " + str(e)
key = os.environ["API_KEY"]
out = {
  "dnat": get("https://api.allowed.test/leak-header", {"Authorization": "Bearer " + key}, None),
  "proxy": get("https://api.allowed.test/leak-header", {"Authorization": "Bearer " + key},
               os.environ["HTTPS_PROXY"]),
  "other_domain": get("https://third.allowed.test/echo", {"Authorization": "Bearer " + key}, None),
  "plain_http": get("http://api.allowed.test/", {"Authorization": "Bearer " + key}, None),
  "direct_ip": get("http://" + sys.argv[2] + "/", {}, None),
  "disallowed": get("https://evil.test/", {}, None),
}
print(json.dumps(out))
"""


async def test_vm_reaches_api_with_injected_secret(state_dir: Path, guest_image: GuestImage) -> None:
    octet = 200 + secrets.randbelow(50)
    sink = ListSink()
    runtime = QemuRuntime(Settings(state_dir=state_dir), accel="auto", accel_cache=False)
    async with outside_world(octet) as world:
        service = EgressService(NetworkManager(), world.broker(sink), sink)
        sid = new_id("sbx")
        attached = await service.attach(sid, world_policy(), session_id="ses_vm")
        sandbox = None
        try:
            sandbox = await runtime.boot(VMSpec(image=guest_image, network=attached.net), sandbox_id=sid)
            await sandbox.guest.write_file(CA_PATH, attached.ca_pem)
            env = dict(attached.env)
            result = await sandbox.guest.exec(["python3", "-c", GUEST_CLIENT, CA_PATH, world.ip], env=env,
                                              timeout=240)
            assert result.exit_code == 0, result.stderr.decode()
            out = json.loads(result.stdout)
            for path in ("dnat", "proxy"):
                status, body = out[path]
                assert status == 200, (path, body)
                assert json.loads(body)["headers"]["authorization"] == "Bearer [REDACTED]"
                assert SECRET not in body
            assert out["other_domain"][0] == 403
            assert out["plain_http"][0] == 403
            assert out["direct_ip"][0] == 403
            assert out["disallowed"][0] == 0  # the stub does not even resolve it
            injected = [e for e in sink.events if e.kind == "http" and e.secret_ids == [SECRET_ID]]
            assert len(injected) == 2 and all(e.status == 200 for e in injected)
            assert {e.session_id for e in sink.events} == {"ses_vm"}

            # No byte of the secret anywhere in the sandbox: environment, disk, memory.
            env_dump = await sandbox.guest.exec(["sh", "-c", "cat /proc/*/environ 2>/dev/null; env"], env=env)
            assert SECRET.encode() not in env_dump.stdout
            assert attached.env["API_KEY"].encode() in env_dump.stdout  # what it holds is the placeholder
            await sandbox.guest.exec(["sync"])
            assert sandbox.pid is not None
            assert not await asyncio.to_thread(memory_contains, sandbox.pid, SECRET.encode())
            # The search itself works: the placeholder the guest used is in its memory.
            assert await asyncio.to_thread(memory_contains, sandbox.pid, attached.env["API_KEY"].encode())
            assert not await asyncio.to_thread(file_contains, sandbox.workdir / "disk.img", SECRET.encode())
        finally:
            if sandbox is not None:
                await runtime.destroy(sandbox)
            await runtime.close()
            await service.close()

"""A VM with ``spec.network``: its NIC is the tap in the sandbox's namespace (capsa.node.net), under the
namespace's real nftables rules. Only addresses inside the namespace this test creates are used."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.net.nsexec import open_listener
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables not installed"),
]

GUEST_PROBE = """
import socket, sys
gw = sys.argv[1]
s = socket.create_connection((gw, 80), timeout=20)   # DNAT-ed by the namespace to the node's port
print("allowed:", s.recv(100).decode())
s.close()
try:
    socket.create_connection((gw, 2222), timeout=3)
    print("other port: connected")
except OSError as exc:
    print("other port:", type(exc).__name__)
"""


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cvn-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_vm_nic_sits_behind_the_sandbox_namespace(state_dir: Path, guest_image: GuestImage) -> None:
    manager = NetworkManager()
    sid = new_id("sbx")
    net = await manager.create(sid)
    runtime = QemuRuntime(Settings(state_dir=state_dir), accel="auto", accel_cache=False)
    listener = open_listener(net.netns, net.gateway_ip, net.ports.http)
    try:
        sandbox = await runtime.boot(VMSpec(image=guest_image, network=net), sandbox_id=sid)
        assert sandbox.pid is not None
        assert b"-netdev" in _cmdline(sandbox.pid)
        addr = await sandbox.guest.exec(["ip", "-4", "-o", "addr", "show"])
        assert f"{net.guest_ip}/{net.prefixlen}" in addr.stdout.decode()
        resolv = await sandbox.guest.read_file("/etc/resolv.conf")
        assert resolv == f"nameserver {net.gateway_ip}\n".encode()

        loop = asyncio.get_running_loop()

        async def serve_one() -> None:
            conn, _ = await loop.sock_accept(listener)
            with conn:
                await loop.sock_sendall(conn, b"hello from the node")

        server = asyncio.create_task(serve_one())
        probe = await sandbox.guest.exec(["python3", "-c", GUEST_PROBE, net.gateway_ip], timeout=60)
        await asyncio.wait_for(server, 30)
        assert probe.exit_code == 0, probe.stderr
        lines = probe.stdout.decode().splitlines()
        assert lines[0] == "allowed: hello from the node"
        assert lines[1] in ("other port: TimeoutError", "other port: timeout")
        counters = await manager.drop_counters(net)
        assert counters.get("drop_tcp", 0) >= 1
        await runtime.destroy(sandbox)
    finally:
        listener.close()
        await runtime.close()
        await manager.destroy(net)
    assert await manager.leftovers(net) == []
    assert list((state_dir / "vms").iterdir()) == []

"""A compromised QEMU is a process of its VM uid with nothing else: no host network (a network namespace
of its own holding only a loopback, the sandbox's tap passed as a descriptor), no groups, no capabilities,
no new privileges, and a uid no other live VM has.

Attack performed: from inside QEMU's namespaces (``nsenter`` into the QEMU process's network namespace,
as its uid), connect to a TCP listener the test opens on the host's loopback, which is what an escaped
guest would try first (control plane, internal services, cloud metadata)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from capsa.common.ids import new_id
from capsa.common.image import GuestImage
from capsa.node.net.nsexec import open_listener
from capsa.node.net.sandbox_net import NetworkManager
from capsa.node.runtime.base import VMSpec
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from capsa.node.runtime.workdir import VM_UID_BASE, VM_UID_COUNT

pytestmark = [
    pytest.mark.vm,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (VM uids, namespaces)"),
    pytest.mark.asyncio(loop_scope="module"),
]


def _netns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _interfaces(pid: int) -> list[str]:
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


def _status(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _connect_from(pid: int, uid: int, port: int) -> subprocess.CompletedProcess[str]:
    """As ``uid`` inside QEMU ``pid``'s network namespace, try to reach 127.0.0.1:``port``."""
    probe = ("import socket,sys\n"
             "try:\n"
             f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).close(); print('connected')\n"
             "except OSError as exc:\n"
             "    print('refused', exc.errno)\n")
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", "setpriv", f"--reuid={uid}",
                           f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", probe],
                          capture_output=True, text=True, timeout=30, check=False)


def _check_isolated(sb: QemuSandbox) -> None:
    assert sb.pid is not None and sb.vm_uid is not None
    pid, uid = sb.pid, sb.vm_uid
    assert _netns(pid) != _netns("self"), "QEMU shares the node's network namespace"
    assert _interfaces(pid) == ["lo"], _interfaces(pid)
    status = _status(pid)
    assert status["Uid"].split() == [str(uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(uid)] * 4, status["Gid"]
    assert status["Groups"] == "", status["Groups"]
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert status["NoNewPrivs"] == "1"
    assert VM_UID_BASE <= uid < VM_UID_BASE + VM_UID_COUNT


async def test_qemu_has_no_host_network_and_no_privileges(runtime: QemuRuntime,
                                                          guest_image: GuestImage) -> None:
    host = socket.create_server(("127.0.0.1", 0))
    port = host.getsockname()[1]
    a = await runtime.boot(VMSpec(image=guest_image, memory_mib=128))
    b = await runtime.boot(VMSpec(image=guest_image, memory_mib=128))
    try:
        assert isinstance(a, QemuSandbox) and isinstance(b, QemuSandbox)
        for sb in (a, b):
            _check_isolated(sb)
        assert a.pid is not None and b.pid is not None and a.vm_uid is not None
        # One namespace per QEMU, and one uid per live VM.
        assert _netns(a.pid) != _netns(b.pid)
        assert a.vm_uid != b.vm_uid and {a.vm_uid, b.vm_uid} <= runtime.vm_uids.live
        # The attack: the node's loopback listener is out of reach from QEMU's namespace.
        escaped = await asyncio.to_thread(_connect_from, a.pid, a.vm_uid, port)
        assert escaped.stdout.strip().startswith("refused"), (escaped.stdout, escaped.stderr)
        # (The same probe from the host namespace does connect: the listener is real.)
        reachable = await asyncio.to_thread(
            subprocess.run, ["/usr/bin/python3", "-c",
                             f"import socket; socket.create_connection(('127.0.0.1', {port}), 3)"],
            capture_output=True, timeout=30, check=False)
        assert reachable.returncode == 0, reachable.stderr
        assert (await a.guest.exec(["echo", "ok"])).stdout == b"ok\n"
    finally:
        host.close()
        uids = {a.vm_uid, b.vm_uid}
        await runtime.destroy(a)
        await runtime.destroy(b)
    assert not uids & runtime.vm_uids.live, "destroy must release the VM uids"


@pytest.mark.skipif(shutil.which("nft") is None, reason="nftables not installed")
async def test_networked_qemu_gets_its_tap_as_a_descriptor_only(runtime: QemuRuntime,
                                                                guest_image: GuestImage) -> None:
    manager = NetworkManager()
    sid = new_id("sbx")
    net = await manager.create(sid)
    try:
        sb = await runtime.boot(VMSpec(image=guest_image, memory_mib=128, network=net), sandbox_id=sid)
        try:
            assert isinstance(sb, QemuSandbox) and sb.pid is not None
            _check_isolated(sb)
            # Not in the sandbox's namespace either: the tap is there, QEMU only holds its descriptor.
            sandbox_ns = os.stat(f"/run/netns/{net.netns}").st_ino
            assert os.stat(f"/proc/{sb.pid}/ns/net").st_ino != sandbox_ns
            fds = [os.readlink(f"/proc/{sb.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{sb.pid}/fd")]
            assert "/dev/net/tun" in fds, fds
            # The NIC works through that descriptor: launch configured the guest address over it.
            addr = await sb.guest.exec(["ip", "-4", "-o", "addr", "show"])
            assert f"{net.guest_ip}/{net.prefixlen}" in addr.stdout.decode()
            listener = open_listener(net.netns, net.gateway_ip, net.ports.http)
            try:
                listener.setblocking(True)
                listener.settimeout(60)
                accepted = asyncio.get_running_loop().run_in_executor(None, listener.accept)
                probe = (f"import socket; s = socket.create_connection(('{net.gateway_ip}', 80), 20); "
                         "print(s.recv(5).decode())")
                run = asyncio.ensure_future(sb.guest.exec(["python3", "-c", probe], timeout=60))
                conn, _ = await accepted
                with conn:
                    conn.sendall(b"hello")
                result = await run
                assert result.stdout == b"hello\n", result.stderr
            finally:
                listener.close()
        finally:
            await runtime.destroy(sb)
    finally:
        await manager.destroy(net)


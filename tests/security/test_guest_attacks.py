"""Attacks run from inside one real microVM (TCG here): escape surface, host-file isolation, disk fill,
memory hog and fork bomb. Each checks a concrete value on the host side of the boundary. The fork bomb
runs last because it may leave the guest unusable."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from capsa.common.image import GuestImage
from capsa.node.runtime.base import SandboxState, VMSpec
from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox
from capsa.node.runtime.workdir import VM_UID_BASE, VM_UID_COUNT

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

MIB = 1024 * 1024
GUEST_MIB = 256
VIRTIO_BLOCK, VIRTIO_CONSOLE = 2, 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(runtime: QemuRuntime, guest_image: GuestImage) -> AsyncIterator[QemuSandbox]:
    sb = await runtime.boot(VMSpec(image=guest_image, memory_mib=GUEST_MIB))
    yield sb
    await runtime.destroy(sb)


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _kib(value: str) -> int:
    return int(value.split()[0]) * 1024


def _pids_of_uid(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except FileNotFoundError:
                pass
    return sorted(found)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def _sh(sandbox: QemuSandbox, cmd: str, timeout: float = 120) -> str:  # noqa: ASYNC109
    result = await sandbox.guest.exec(cmd, timeout=timeout)
    assert result.exit_code == 0, (cmd, result)
    return result.stdout.decode()


async def test_guest_sees_only_virtio_block_and_console(sandbox: QemuSandbox) -> None:
    devices = await _sh(sandbox, "cat /sys/bus/virtio/devices/*/device")
    assert sorted(int(d, 16) for d in devices.split()) == [VIRTIO_BLOCK, VIRTIO_CONSOLE]
    present = await _sh(sandbox, "for d in /dev/kvm /dev/vhost-net /dev/vhost-vsock /dev/vsock "
                                 "/dev/sda /dev/vdb /dev/nvme0; do [ -e $d ] && echo $d; done; true")
    assert present.split() == []
    fstypes = {line.split()[2] for line in (await _sh(sandbox, "cat /proc/mounts")).splitlines()}
    assert not fstypes & {"9p", "virtiofs", "nfs", "nfs4", "cifs", "fuse"}, fstypes
    assert (await _sh(sandbox, "ls /sys/class/net")).split() == ["lo"]
    # The only host channel is the agent port; QMP is not wired into the guest at all.
    assert (await _sh(sandbox, "cat /sys/class/virtio-ports/*/name")).split() == ["agent0"]


async def test_qmp_socket_is_not_reachable_from_the_guest(sandbox: QemuSandbox, state_dir: Path) -> None:
    qmp = [p for p in sandbox.workdir.rglob("*") if p.is_socket() and "qmp" in p.name]
    assert qmp, "expected a QMP socket on the host side"
    probe = ("import socket,sys\n"
             "s=socket.socket(socket.AF_UNIX)\n"
             "try:\n s.connect(sys.argv[1]); print('connected')\n"
             "except OSError as e: print(type(e).__name__)\n")
    result = await sandbox.guest.exec(["python3", "-c", probe, str(qmp[0])])
    assert result.stdout.decode().strip() == "FileNotFoundError", result
    found = await _sh(sandbox, f"ls -d {state_dir} 2>/dev/null; true")
    assert found.strip() == ""


async def test_qemu_process_lands_unprivileged(sandbox: QemuSandbox) -> None:
    assert sandbox.pid is not None
    status = _proc_status(sandbox.pid)
    uids = {int(u) for u in status["Uid"].split()}
    assert all(VM_UID_BASE <= u < VM_UID_BASE + VM_UID_COUNT for u in uids), uids
    assert {int(g) for g in status["Gid"].split()} != {0}
    assert status["Seccomp"] == "2"
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0


async def test_guest_writes_never_reach_the_host_image(sandbox: QemuSandbox, guest_image: GuestImage) -> None:
    before = await asyncio.to_thread(_sha256, guest_image.rootfs)
    await _sh(sandbox, "echo hostile > /etc/hostile && echo 'evil::0:0::/:/bin/sh' >> /etc/passwd && sync")
    assert (await _sh(sandbox, "cat /etc/hostile")) == "hostile\n"
    host_passwd = await asyncio.to_thread(Path("/etc/passwd").read_text)
    assert not await asyncio.to_thread(Path("/etc/hostile").exists)
    assert "evil::0:0" not in host_passwd
    after = await asyncio.to_thread(_sha256, guest_image.rootfs)
    assert after == before
    # The write landed in the VM's own copy, which is a different file from the template.
    disk = sandbox.workdir / "disk.img"
    assert disk.stat().st_ino != guest_image.rootfs.stat().st_ino


async def test_disk_fill_stops_at_the_configured_size(sandbox: QemuSandbox) -> None:
    disk = sandbox.workdir / "disk.img"
    size_before = disk.stat().st_size
    host_free_before = shutil.disk_usage(disk.parent).free
    result = await sandbox.guest.exec("dd if=/dev/zero of=/fill bs=1M; sync", timeout=600)
    assert b"No space left on device" in result.stderr, result.stderr[-500:]
    st = disk.stat()
    host_free_after = shutil.disk_usage(disk.parent).free
    dropped = (host_free_before - host_free_after) / MIB
    print(f"disk fill: file {st.st_size / MIB:.0f} MiB apparent, {st.st_blocks * 512 / MIB:.0f} MiB "
          f"allocated; host free dropped {dropped:.0f} MiB; took {result.duration:.1f}s")
    assert st.st_size == size_before
    assert st.st_blocks * 512 <= size_before + MIB
    # Other work shares this host disk, so allow slack beyond the disk's own size.
    assert host_free_before - host_free_after <= size_before + 512 * MIB
    await _sh(sandbox, "rm -f /fill && sync")
    assert await _sh(sandbox, "echo alive") == "alive\n"


async def _vmstat_oom_kills(sandbox: QemuSandbox) -> int:
    """The guest kernel's count of processes any OOM killer has killed since boot."""
    for line in (await sandbox.guest.read_file("/proc/vmstat")).decode().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise AssertionError("the guest kernel has no oom_kill counter in /proc/vmstat")


async def test_memory_hog_meets_the_guest_oom_killer(sandbox: QemuSandbox) -> None:
    assert sandbox.pid is not None
    hog = ("chunks=[]\n"
           "for i in range(4 * 1024):\n"
           " b=bytearray(1024*1024)\n"
           " for j in range(0, len(b), 4096): b[j]=1\n"
           " chunks.append(b)\n"
           "print('survived')\n")
    kills_before = await _vmstat_oom_kills(sandbox)
    result = await sandbox.guest.exec(["python3", "-c", hog], timeout=300)
    outcome = (f"exit={result.exit_code} signal={result.signal} timed_out={result.timed_out} "
               f"oom_killed={result.oom_killed} after {result.duration:.1f}s")
    print(f"memory hog: {outcome}")
    assert b"survived" not in result.stdout
    # Killed by the guest kernel's OOM killer, as the kernel itself counts it: the oom_kill counter of
    # the command's own cgroup (the daemon reports it) and the global one. Not the kernel log: a SIGKILL
    # can also come from the command's timeout (its cgroup is killed), and the log is a ring others may
    # read, clear or overrun.
    assert result.signal == 9 and not result.timed_out, outcome
    assert result.oom_killed, outcome
    assert await _vmstat_oom_kills(sandbox) > kills_before
    hwm = _kib(_proc_status(sandbox.pid)["VmHWM"])
    print(f"memory hog: QEMU peak RSS {hwm / MIB:.0f} MiB for a {GUEST_MIB} MiB guest")
    assert hwm < 3 * GUEST_MIB * MIB
    assert (await sandbox.guest.health(timeout=30)) is not None
    assert await _sh(sandbox, "echo alive") == "alive\n"


async def test_fork_bomb_does_not_reach_the_host(sandbox: QemuSandbox) -> None:
    assert sandbox.pid is not None
    uid = int(_proc_status(sandbox.pid)["Uid"].split()[0])
    assert _pids_of_uid(uid) == [sandbox.pid]
    threads_before = int(_proc_status(sandbox.pid)["Threads"])
    # User commands may hold one process per MiB of guest memory (less than that MemTotal shows).
    assert 128 <= int(await _sh(sandbox, "cat /sys/fs/cgroup/work/pids.max")) <= GUEST_MIB
    # The outer bound is ours; the guest must enforce its own 15 s timeout: user commands run in a
    # cgroup with a process cap and a low CPU weight, the daemon in one with a high weight.
    result = await asyncio.wait_for(sandbox.guest.exec("f(){ f | f & }; f; sleep 30", timeout=15), timeout=90)
    outcome = f"timed_out={result.timed_out} exit={result.exit_code} signal={result.signal}"
    # Ended by its timeout, or by the guest's OOM killer taking the command's whole cgroup.
    assert result.timed_out or result.signal == 9, outcome
    status = _proc_status(sandbox.pid)
    print(f"fork bomb exec: {outcome}; QEMU threads {threads_before} -> {status['Threads']}, "
          f"state {status['State']}")
    # Guest processes are not host processes: QEMU is still the VM user's only process, with its
    # thread count not multiplied by the guest's process count.
    assert _pids_of_uid(uid) == [sandbox.pid]
    assert int(status["Threads"]) < threads_before + 64
    assert not status["State"].startswith("Z")


async def test_after_fork_bomb_the_sandbox_is_usable_again(sandbox: QemuSandbox) -> None:
    await sandbox.guest.health(timeout=60)
    assert sandbox.state is SandboxState.RUNNING
    # The timeout killed the bomb's whole cgroup: nothing of it is left in the guest (the probe itself
    # is the only process under `work`; killed processes may take a moment to be reaped).
    count = -1
    for _ in range(30):
        left = await sandbox.guest.exec(["cat", "/sys/fs/cgroup/work/pids.current"], timeout=30)
        assert left.exit_code == 0, left.stderr
        count = int(left.stdout.decode().strip())
        if count <= 1:
            break
        await asyncio.sleep(1)
    assert count <= 1, f"{count} processes of the fork bomb survived its timeout"

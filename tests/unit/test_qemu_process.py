"""A real QEMU process (microvm without a kernel: it idles in firmware) managed by QemuProcess.

These need no guest image: they check privilege dropping, seccomp, QMP, the stop escalation, the exit
watcher's view of a SIGKILL from outside, orphan detection and the bounded console log.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.node.runtime.hostinfo import qemu_binary
from capsa.node.runtime.qemu.cmdline import SANDBOX_OPTIONS
from capsa.node.runtime.qemu.process import QemuProcess, _BoundedLog
from capsa.node.runtime.workdir import (
    VmDir,
    find_qemu_pids,
    kill_and_wait,
    pick_vm_uid,
    process_start_time,
    read_pidfile,
)

pytestmark = pytest.mark.root


@pytest.fixture
def vms() -> Iterator[Path]:
    # Short path: Unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="cq-") as tmp:
        os.chmod(tmp, 0o711)  # the unprivileged VM user must be able to traverse to its folder
        yield Path(tmp) / "vms"


def _argv(vmdir: VmDir) -> list[str]:
    return [
        qemu_binary(), "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,acpi=on",
        "-accel", "tcg", "-m", "32M", "-nodefaults", "-no-user-config", "-display", "none",
        "-sandbox", SANDBOX_OPTIONS,
        "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
        "-qmp", f"unix:{vmdir.qmp_socket},server=on,wait=off",
    ]


def _limits(pid: int) -> str:
    return Path(f"/proc/{pid}/limits").read_text()


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


async def _started(vms: Path, name: str = "sbx_test") -> tuple[VmDir, QemuProcess, int]:
    uid = pick_vm_uid(vms)
    vmdir = VmDir(vms / name)
    vmdir.create((uid, uid))
    proc = QemuProcess(_argv(vmdir), vmdir, user=(uid, uid))
    await proc.start()
    await proc.connect_qmp(20)
    return vmdir, proc, uid


async def test_runs_unprivileged_under_seccomp_and_quits_via_qmp(vms: Path) -> None:
    vmdir, proc, uid = await _started(vms)
    assert proc.pid is not None
    status = _status(proc.pid)
    assert status["Uid"].split() == [str(uid)] * 4
    assert status["Gid"].split() == [str(uid)] * 4
    assert status["Groups"] == ""
    assert status["Seccomp"] == "2"  # filter mode
    assert status["NoNewPrivs"] == "1"
    assert re.search(r"^Max core file size\s+0\s+0\s", _limits(proc.pid), re.MULTILINE)
    assert os.getpgid(proc.pid) == proc.pid  # own process group: a terminal Ctrl-C does not reach it
    assert read_pidfile(vmdir) == proc.pid
    assert find_qemu_pids(vms) == [proc.pid]
    status_reply = await proc.qmp("query-status")
    assert isinstance(status_reply, dict) and status_reply["running"] is True
    # The node's files are not writable by QEMU's user; its socket folder is.
    assert vmdir.root.stat().st_uid == 0 and vmdir.root.stat().st_mode & 0o777 == 0o711
    assert vmdir.run.stat().st_uid == uid and vmdir.run.stat().st_mode & 0o777 == 0o700
    assert vmdir.pidfile.stat().st_uid == 0
    how = await proc.stop()
    assert how == "qmp quit"
    assert proc.returncode == 0
    assert not vmdir.qmp_socket.exists()
    vmdir.remove()
    assert not vmdir.root.exists()


async def test_sigkill_from_outside_is_seen_by_wait(vms: Path) -> None:
    vmdir, proc, _ = await _started(vms)
    assert proc.pid is not None
    waiter = asyncio.create_task(proc.wait())
    await asyncio.sleep(0.1)
    assert not waiter.done()
    os.kill(proc.pid, signal.SIGKILL)
    code = await asyncio.wait_for(waiter, 10)
    assert code == -signal.SIGKILL
    assert proc.exit_description() == "qemu was killed by signal 9 (SIGKILL)"
    assert await proc.stop() == "already exited"
    vmdir.remove()


async def test_stop_escalates_when_qmp_is_unavailable(vms: Path) -> None:
    vmdir, proc, _ = await _started(vms)
    assert proc.pid is not None
    await proc.close()  # drop the monitor connection: quit cannot be sent
    os.kill(proc.pid, signal.SIGSTOP)  # a stopped process ignores SIGTERM until continued
    how = await proc.stop(quit_timeout=0.2, term_timeout=0.5)
    assert how == "sigkill"
    assert proc.returncode == -signal.SIGKILL
    vmdir.remove()


async def test_failure_to_start_reports_qemu_stderr(vms: Path) -> None:
    vmdir = VmDir(vms / "sbx_bad")
    vmdir.create(None)
    proc = QemuProcess([*_argv(vmdir), "-device", "no-such-device"], vmdir)
    await proc.start()
    with pytest.raises(Exception, match="no-such-device"):
        await proc.connect_qmp(20)
    assert proc.returncode == 1
    await proc.close()
    vmdir.remove()


async def test_orphan_helpers_kill_a_process_that_is_not_our_child(vms: Path) -> None:
    # A QEMU started by "a previous node": spawned here, but only found again through the pidfile.
    vmdir, proc, _ = await _started(vms, "sbx_orphan")
    pid = proc.pid
    assert pid is not None
    start = process_start_time(pid)
    assert start is not None
    killer = asyncio.create_task(asyncio.to_thread(kill_and_wait, pid))
    await asyncio.wait_for(proc.wait(), 10)  # reap it, as its real parent would
    assert await killer is True
    assert read_pidfile(vmdir) is None
    assert find_qemu_pids(vms) == []
    await proc.close()
    vmdir.remove()


def test_pidfile_rejects_reused_pids(vms: Path) -> None:
    vmdir = VmDir(vms / "sbx_pid")
    vmdir.create(None)
    vmdir.write_pid(os.getpid())  # this pytest process: alive, but its command line is not this VM's
    assert read_pidfile(vmdir) is None
    vmdir.pidfile.write_text(f"{os.getpid()} 1\n")  # wrong start time
    assert read_pidfile(vmdir) is None
    vmdir.pidfile.write_text("garbage")
    assert read_pidfile(vmdir) is None


def test_socket_path_length_is_checked() -> None:
    with pytest.raises(ValueError, match="too deep"):
        VmDir(Path("/" + "x" * 100) / "sbx_1").check_socket_paths()
    VmDir(Path("/var/lib/capsa/vms/sbx_0123456789abcdefghij")).check_socket_paths()


def test_console_log_is_bounded(tmp_path: Path) -> None:
    log = _BoundedLog(tmp_path / "console.log", 8192)
    for i in range(1000):
        log.write(f"line {i:04d} ".encode() * 10 + b"\n")
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["console.log", "console.log.1"]
    assert all((tmp_path / f).stat().st_size <= 8192 for f in files)
    assert "line 0999" in log.text_tail()
    assert (tmp_path / "console.log").read_text().rstrip().endswith("line 0999")

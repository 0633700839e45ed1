"""The guest init and daemon start-up: option parsing, port lookup, and the init as PID 1 of fresh
namespaces on the host (mounts, loopback, daemon restart, reaping, power off)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from capsa.guest.daemon import find_port
from capsa.guest.init import cmdline_options
from tests.support.local_guest import GUEST_PACKAGE

T = TypeVar("T")


def test_cmdline_options() -> None:
    text = ("console=ttyS0 root=/dev/vda rw capsa.hostname=box-1 capsa.device=/dev/vport1p1 "
            "capsa.empty= capsa.flag quiet\n")
    assert cmdline_options(text) == {"hostname": "box-1", "device": "/dev/vport1p1", "empty": ""}
    assert cmdline_options("") == {}


def test_find_port_by_name_without_udev(tmp_path: Path) -> None:
    # What the kernel publishes for each virtio-serial port: /sys/class/virtio-ports/<dev>/name.
    for dev, name in [("vport1p0", "other"), ("null", "agent0")]:
        (tmp_path / dev).mkdir()
        (tmp_path / dev / "name").write_text(name + "\n")
    assert find_port("/dev/virtio-ports/agent0", sysfs=str(tmp_path)) == "/dev/null"
    assert find_port("/dev/virtio-ports/missing", sysfs=str(tmp_path)) is None
    assert find_port("/dev/zero", sysfs=str(tmp_path)) == "/dev/zero"  # an existing path wins
    assert find_port("/dev/virtio-ports/agent0", sysfs=str(tmp_path / "none")) is None


# -- the real init as PID 1 of fresh PID/mount/UTS/network namespaces ------------------------------

SETUP = r"""
set -eu
R="$1"; LIB="$2"
mount -t tmpfs -o mode=0755 capsa-init-root "$R"
mkdir -p "$R/usr" "$R/etc" "$R/opt/capsa" "$R/dev" "$R/proc" "$R/sys" "$R/tmp" "$R/run"
for d in usr etc; do mount --bind "/$d" "$R/$d"; mount -o remount,bind,ro "$R/$d"; done
mount --bind "$LIB" "$R/opt/capsa"; mount -o remount,bind,ro "$R/opt/capsa"
for l in bin lib lib64 sbin; do [ -L "/$l" ] && ln -s "$(readlink "/$l")" "$R/$l"; done
# A private /dev: init then leaves devtmpfs alone, so the host's /dev is never touched.
mount -t tmpfs -o mode=0755 capsa-init-dev "$R/dev"
mknod -m 666 "$R/dev/null" c 1 3
mkdir -p "$R/dev/virtio-ports"
printf '(none)' > /proc/sys/kernel/hostname  # this UTS namespace's name, as in a fresh VM
cd /
exec env -i PYTHONPATH=/opt/capsa /usr/sbin/chroot "$R" /usr/bin/python3 -m capsa.guest.init
"""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _until(check: Callable[[], T | None], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout} s: {check}")


@pytest.mark.root
def test_init_as_pid1(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, unshare and nsenter (PID/mount namespaces)")
    lib = tmp_path / "lib"
    (lib / "capsa").mkdir(parents=True)
    (lib / "capsa" / "__init__.py").write_text("")
    shutil.copytree(GUEST_PACKAGE, lib / "capsa" / "guest",
                    ignore=shutil.ignore_patterns("__pycache__"))
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount", "--uts", "--net", "--propagation", "private",
         "sh", "-c", SETUP, "setup", str(root), str(lib)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        init = _until(lambda: next((c for c in _children(proc.pid)
                                    if "capsa.guest.init" in _cmdline(c)), None))
        daemon = _until(lambda: next((c for c in _children(init) if "--device" in _cmdline(c)), None))
        assert "--allow-poweroff" in _cmdline(daemon)

        with open(f"/proc/{init}/mounts") as f:
            mounts = {line.split()[1]: line.split()[2] for line in f}
        for target, fstype in [("/proc", "proc"), ("/sys", "sysfs"), ("/dev/pts", "devpts"),
                               ("/dev/shm", "tmpfs"), ("/run", "tmpfs"), ("/tmp", "tmpfs")]:
            assert mounts.get(target) == fstype, (target, mounts)
        assert os.readlink(f"/proc/{init}/root/dev/fd") == "/proc/self/fd"
        with open(f"/proc/{init}/root/sys/class/net/lo/flags") as f:
            assert int(f.read(), 16) & 1  # IFF_UP

        uts = subprocess.run(["nsenter", "--target", str(init), "--uts", "cat", "/proc/sys/kernel/hostname"],
                             capture_output=True, text=True, check=True)
        assert uts.stdout.strip() == "capsa"  # an unnamed machine gets the default name

        # A daemon that dies is started again.
        os.kill(daemon, signal.SIGKILL)
        _until(lambda: next((c for c in _children(init) if c != daemon and "--device" in _cmdline(c)), None))

        # Orphans inside the namespace are re-parented to init, which reaps them: no zombies stay. Each
        # subshell exits at once, leaving its sleep to init; the test kills them, and each must then go.
        subprocess.run(["nsenter", "--target", str(init), "--pid", "--mount", "--root", "--wd=/",
                        "/bin/sh", "-c", "for i in 1 2 3 4 5; do (sleep 1234 &) ; done"], check=True)

        def orphans_of_init() -> list[int] | None:
            found = [c for c in _children(init) if _cmdline(c).strip() == "sleep 1234"]
            return found if len(found) == 5 else None

        orphans = _until(orphans_of_init)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        # They exited (a zombie until reaped, or gone), then init reaped every one: none stays a zombie.
        _until(lambda: all(_state(pid) in ("Z", "gone") for pid in orphans))
        _until(lambda: all(_state(pid) == "gone" for pid in orphans), timeout=10.0)
        assert [c for c in _children(init) if _state(c) == "Z"] == []

        # SIGTERM: stop everything, sync, remount read-only, reboot(RB_POWER_OFF). In a PID namespace
        # the kernel turns that reboot into SIGINT for the namespace's init, which unshare reports.
        os.kill(init, signal.SIGTERM)
        rc = proc.wait(60)
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert rc == -signal.SIGINT, (rc, output)
        assert "remount / read-only" not in output, output  # the remount of the (tmpfs) root worked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""User commands in a real microVM are placed before they run: each one is in a cgroup of its own under
'work' with a normal OOM score from its first instruction (the daemon spawns it held, moves it, then lets
it exec), and a timeout kills the whole cgroup, grandchildren that left the session included."""

from __future__ import annotations

import shutil

import pytest

from capsa.node.runtime.qemu import QemuSandbox

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

TIMEOUT = 60.0


async def test_a_command_is_in_its_own_cgroup_from_its_first_instruction(sandbox: QemuSandbox) -> None:
    # The program itself is the reader: nothing ran before it but the daemon's held shim.
    r = await sandbox.guest.exec(["cat", "/proc/self/cgroup"], timeout=TIMEOUT)
    assert r.stdout.decode().strip() == f"0::/work/c{r.pid}", r
    r = await sandbox.guest.exec(["cat", "/proc/self/oom_score_adj"], timeout=TIMEOUT)
    assert r.stdout.decode().strip() == "0", r
    r = await sandbox.guest.exec("cat /proc/self/cgroup; echo $$", timeout=TIMEOUT)
    cgroup, shell_pid = r.stdout.decode().split()
    assert shell_pid == str(r.pid) and cgroup.startswith("0::/work/c"), r  # cat: a child in the group
    assert cgroup == f"0::/work/c{r.pid}"
    proc = await sandbox.guest.start_process(["cat", "/proc/self/cgroup"])
    await sandbox.guest.wait_process(proc.pid, timeout=TIMEOUT)
    out = await sandbox.guest.process_output(proc.pid)
    assert out.stdout.decode().strip() == f"0::/work/c{proc.pid}"
    # Each command's group is removed once it is done; the daemon stays where init put it.
    r = await sandbox.guest.exec("ls /sys/fs/cgroup/work | grep -c '^c[0-9]' ; cat /proc/$PPID/cgroup",
                                 timeout=TIMEOUT)
    count, daemon = r.stdout.decode().split()
    assert count == "1" and daemon == "0::/agent", r


async def test_a_timeout_kills_grandchildren_that_left_the_session(sandbox: QemuSandbox) -> None:
    r = await sandbox.guest.exec(
        "setsid sh -c 'echo $$ > /tmp/escaped; exec sleep 300' & sleep 300", timeout=2)
    assert r.timed_out, r
    pid = (await sandbox.guest.read_file("/tmp/escaped")).decode().strip()
    # SIGKILL is delivered at once; give PID 1 a moment to reap the orphan.
    check = await sandbox.guest.exec(
        f"for i in $(seq 50); do kill -0 {pid} 2>/dev/null || break; sleep 0.1; done; "
        f"kill -0 {pid} 2>/dev/null && echo alive || echo gone; "
        f"cat /sys/fs/cgroup/work/c{r.pid}/cgroup.procs 2>/dev/null | wc -l", timeout=TIMEOUT)
    assert check.stdout.decode().split() == ["gone", "0"], check

"""User commands in a real microVM are placed before they run: each one is in a cgroup of its own under
'work' with a normal OOM score from its first instruction (born there: the daemon steps into the group for
its fork; or, with 'work' at its process cap, spawned held, moved, then let go on to exec), and a timeout
kills the whole cgroup, grandchildren that left the session included."""

from __future__ import annotations

import asyncio
import re
import shutil

import pytest

from capsa.node.runtime.qemu import QemuSandbox
from tests.support.guest_waits import wait_exit

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

TIMEOUT = 60.0


async def test_a_command_is_in_its_own_cgroup_from_its_first_instruction(sandbox: QemuSandbox) -> None:
    # The program itself is the reader: nothing ran before it (it was born in its group).
    first = await sandbox.guest.exec(["cat", "/proc/self/cgroup"], timeout=TIMEOUT)
    second = await sandbox.guest.exec(["cat", "/proc/self/cgroup"], timeout=TIMEOUT)
    groups = [r.stdout.decode().strip() for r in (first, second)]
    assert all(re.fullmatch(r"0::/work/n[0-9]+", g) for g in groups) and groups[0] != groups[1], groups
    r = await sandbox.guest.exec(["cat", "/proc/self/oom_score_adj"], timeout=TIMEOUT)
    assert r.stdout.decode().strip() == "0", r
    # A shell command line: the shell and what it runs share the group, and nothing else is in it.
    r = await sandbox.guest.exec(
        "g=$(cut -d: -f3 /proc/self/cgroup); echo $g $$; cat /sys/fs/cgroup$g/cgroup.procs", timeout=TIMEOUT)
    group, shell_pid, *members = r.stdout.decode().split()
    assert shell_pid == str(r.pid) and re.fullmatch(r"/work/n[0-9]+", group), r
    assert shell_pid in members and len(members) <= 2, r  # the shell and its cat
    proc = await sandbox.guest.start_process(["cat", "/proc/self/cgroup"])
    await wait_exit(sandbox.guest, proc.pid, timeout=TIMEOUT)
    out = await sandbox.guest.process_output(proc.pid)
    assert re.fullmatch(r"0::/work/n[0-9]+", out.stdout.decode().strip()), out
    # Each command's group is removed once it is done; the daemon stays where init put it.
    r = await sandbox.guest.exec(
        "ls /sys/fs/cgroup/work | grep -c '^[cn][0-9]' ; cat /proc/$PPID/cgroup /proc/$PPID/oom_score_adj",
        timeout=TIMEOUT)
    count, daemon, daemon_oom = r.stdout.decode().split()
    assert count == "1" and daemon == "0::/agent" and daemon_oom == "-1000", r


async def test_with_work_at_its_process_cap_a_command_is_still_placed(sandbox: QemuSandbox) -> None:
    # Sleepers fill 'work' up to pids.max: the shell and cap - 1 sleeps (the shell then becomes the last
    # one). A command can then not be born in a group under 'work' (its fork would fail): it is spawned
    # held in 'agent' and moved. Polled through the files API, which spawns nothing.
    filler = await sandbox.guest.start_process(
        "cap=$(cat /sys/fs/cgroup/work/pids.max); i=1; "
        "while [ $i -lt $cap ]; do sleep 600 & i=$((i+1)); done; "
        "echo $cap > /tmp/full; exec sleep 600")
    try:
        cap = ""
        for _ in range(240):
            # The shell creates the file before echo fills it: wait for the content, not the name.
            if "full" in {entry.name for entry in await sandbox.guest.list_dir("/tmp")}:
                cap = (await sandbox.guest.read_file("/tmp/full")).decode().strip()
                if cap:
                    break
            await asyncio.sleep(0.5)
        current = (await sandbox.guest.read_file("/sys/fs/cgroup/work/pids.current")).decode().strip()
        assert current == cap, f"{current}/{cap}"
        r = await sandbox.guest.exec(["cat", "/proc/self/cgroup", "/proc/self/oom_score_adj"],
                                     timeout=TIMEOUT)
        assert r.exit_code == 0 and r.stdout.decode().split() == [f"0::/work/c{r.pid}", "0"], r
        # A shell command line (builtins only: a fork of its own would meet the cap, as it should).
        r = await sandbox.guest.exec("read g < /proc/self/cgroup; echo $g $$", timeout=TIMEOUT)
        assert r.exit_code == 0 and r.stdout.decode().split() == [f"0::/work/c{r.pid}", str(r.pid)], r
    finally:
        await sandbox.guest.kill_process(filler.pid, 9)
    for _ in range(60):
        r = await sandbox.guest.exec(["cat", "/sys/fs/cgroup/work/pids.current"], timeout=TIMEOUT)
        if int(r.stdout.decode()) <= 1:
            break
        await asyncio.sleep(0.5)
    assert int(r.stdout.decode()) <= 1, r


async def test_a_timeout_kills_grandchildren_that_left_the_session(sandbox: QemuSandbox) -> None:
    r = await sandbox.guest.exec(
        "cut -d: -f3 /proc/self/cgroup > /tmp/group; setsid sh -c 'echo $$ > /tmp/escaped; exec sleep 300' & "
        "sleep 300", timeout=2)
    assert r.timed_out, r
    pid = (await sandbox.guest.read_file("/tmp/escaped")).decode().strip()
    # SIGKILL is delivered at once; give PID 1 a moment to reap the orphan.
    check = await sandbox.guest.exec(
        f"for i in $(seq 50); do kill -0 {pid} 2>/dev/null || break; sleep 0.1; done; "
        f"kill -0 {pid} 2>/dev/null && echo alive || echo gone; "
        "cat /sys/fs/cgroup$(cat /tmp/group)/cgroup.procs 2>/dev/null | wc -l", timeout=TIMEOUT)
    assert check.stdout.decode().split() == ["gone", "0"], check

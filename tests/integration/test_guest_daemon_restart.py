"""A user command that kills the guest daemon, in a real microVM: the calls in flight fail at once with
``guest_unavailable`` (not at their 60 s timeout), PID 1 restarts the daemon with the same isolation,
the host re-synchronises with the new instance and the sandbox keeps working."""

from __future__ import annotations

import asyncio
import re
import shutil
import time

import pytest

from capsa.node.guestlink.errors import GuestError
from capsa.node.runtime.base import SandboxState
from capsa.node.runtime.qemu import QemuSandbox
from capsa.node.statuses import status_of

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

COMMAND_TIMEOUT = 60.0
# A correctness bound, not a speed benchmark: far below the 60 s the calls would otherwise wait.
FAIL_WITHIN = 20.0


async def _instance(sandbox: QemuSandbox) -> tuple[str, int]:
    health = await sandbox.guest.health(timeout=30)
    instance, pid = health["instance"], health["pid"]
    assert isinstance(instance, str) and instance and isinstance(pid, int)
    return instance, pid


async def _kill_daemon_in_flight(sandbox: QemuSandbox, killer: str) -> float:
    """Run ``killer`` next to a long command; both calls must fail with guest_unavailable. Returns how
    long after the kill started the in-flight calls failed."""
    bystander = asyncio.create_task(sandbox.guest.exec("sleep 50; echo finished", timeout=COMMAND_TIMEOUT))
    await asyncio.sleep(1.0)  # the bystander is running in the guest
    started = time.monotonic()
    with pytest.raises(GuestError) as failure:
        await asyncio.wait_for(sandbox.guest.exec(killer, timeout=COMMAND_TIMEOUT), COMMAND_TIMEOUT + 30)
    elapsed = time.monotonic() - started
    assert failure.value.code == "guest_unavailable", failure.value
    assert status_of(failure.value) == 503
    assert elapsed < FAIL_WITHIN, f"the call in flight failed only after {elapsed:.1f} s"
    with pytest.raises(GuestError) as other:
        await asyncio.wait_for(bystander, FAIL_WITHIN)
    assert other.value.code == "guest_unavailable"
    return elapsed


async def _works_as_before(sandbox: QemuSandbox, tag: str) -> None:
    result = await sandbox.guest.exec(["sh", "-c", f"echo back-{tag}; echo err >&2"], timeout=COMMAND_TIMEOUT)
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"back-{tag}\n".encode(), b"err\n")
    info = await sandbox.guest.write_file(f"/tmp/after-{tag}.txt", b"payload " * 1000)
    assert info.size == 8000
    assert await sandbox.guest.read_file(f"/tmp/after-{tag}.txt") == b"payload " * 1000
    names = {entry.name for entry in await sandbox.guest.list_dir("/tmp")}
    assert f"after-{tag}.txt" in names
    await sandbox.guest.remove(f"/tmp/after-{tag}.txt")
    # The restarted daemon runs where init put the first one: its own cgroup, out of the OOM killer's
    # reach; the command it runs sits in a cgroup of its own under 'work' with a normal OOM score.
    probe = await sandbox.guest.exec(
        "cat /proc/$PPID/cgroup /proc/$PPID/oom_score_adj /proc/self/cgroup /proc/self/oom_score_adj",
        timeout=COMMAND_TIMEOUT)
    daemon_cgroup, daemon_oom, command_cgroup, command_oom = probe.stdout.decode().split()
    assert daemon_cgroup == "0::/agent" and daemon_oom == "-1000", probe
    assert re.fullmatch(r"0::/work/[cn][0-9]+", command_cgroup) and command_oom == "0", probe
    assert sandbox.state is SandboxState.RUNNING


async def test_kill_everything_fails_the_calls_at_once_and_the_session_keeps_working(
        sandbox: QemuSandbox) -> None:
    before, old_pid = await _instance(sandbox)
    restarts = sandbox.guest.daemon_restarts
    elapsed = await _kill_daemon_in_flight(sandbox, "kill -9 -1; sleep 40")
    # QEMU's host end of the port never saw the guest close it: the channel stayed up and the new
    # instance's hello was what told the client.
    assert not sandbox.guest.closed
    assert sandbox.guest.daemon_restarts == restarts + 1
    after, new_pid = await _instance(sandbox)
    assert after != before and new_pid != old_pid
    print(f"kill -9 -1: the in-flight calls failed {elapsed:.2f} s after the kill (daemon restarted)")
    await _works_as_before(sandbox, "all")


async def test_killing_only_the_daemon_is_survived_too(sandbox: QemuSandbox) -> None:
    before, pid = await _instance(sandbox)
    elapsed = await _kill_daemon_in_flight(sandbox, f"kill -9 {pid}; sleep 40")
    after, new_pid = await _instance(sandbox)
    assert after != before and new_pid != pid
    print(f"kill -9 <daemon pid>: the in-flight calls failed {elapsed:.2f} s after the kill")
    await _works_as_before(sandbox, "daemon")

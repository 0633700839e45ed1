"""Per-VM working directories under ``<state_dir>/vms/<sandbox id>``, their pidfiles, and orphan cleanup.

Layout (the directory itself belongs to the node, so a compromised QEMU cannot rewrite its pidfile)::

    <id>/            root, 0711
      qemu.pid       "<pid> <start time in clock ticks>" written by the node, 0600
      console.log    the guest serial console (bounded, rotated to console.log.1), 0600 root
      disk.img       private copy of the image's rootfs, owned by the VM user, 0600
      run/           owned by the VM user, 0700: qmp.sock, agent.sock (created by QEMU)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from capsa.common.layout import Below
from capsa.node.statedir import unsearchable_ancestor

__all__ = [
    "UNIX_PATH_MAX",
    "VM_UID_BASE",
    "VM_UID_COUNT",
    "VmDir",
    "find_qemu_pids",
    "kill_and_wait",
    "pick_vm_uid",
    "process_start_time",
    "read_pidfile",
    "vm_uids_in_use",
]

# sun_path is 108 bytes including the terminating NUL.
UNIX_PATH_MAX = 107
# Each VM's QEMU runs as its own uid from this range (no passwd entry needed), so two VMs cannot signal,
# ptrace or read each other's files even if one QEMU is compromised.
VM_UID_BASE = 1_879_048_192  # 0x70000000, far above any uid a distribution hands out
VM_UID_COUNT = 1_000_000


@dataclass(frozen=True)
class VmDir:
    root: Path

    pidfile = Below("qemu.pid")
    console_log = Below("console.log")
    disk = Below("disk.img")
    run = Below("run")
    qmp_socket = Below("qmp.sock", parent="run")
    agent_socket = Below("agent.sock", parent="run")

    def check_socket_paths(self) -> None:
        longest = max(len(str(self.qmp_socket)), len(str(self.agent_socket)))
        if longest > UNIX_PATH_MAX:
            raise ValueError(f"state directory {self.root.parent} is too deep: socket paths would be "
                             f"{longest} bytes, Unix sockets allow {UNIX_PATH_MAX}")

    def create(self, owner: tuple[int, int] | None) -> None:
        """Make the directory tree; ``owner`` is the VM user (None: QEMU runs as this process's user)."""
        self.root.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        if owner is not None:
            blocked = unsearchable_ancestor(self.root.parent)
            if blocked is not None:
                raise PermissionError(
                    f"QEMU runs as an unprivileged user and cannot reach {self.root}: {blocked} is not "
                    f"searchable by others (chmod o+x {blocked}, or choose another state directory)")
        self.root.mkdir(mode=0o711)  # FileExistsError for a reused id, on purpose
        self.run.mkdir(mode=0o700)
        if owner is not None:
            os.chown(self.run, owner[0], owner[1])

    def write_pid(self, pid: int) -> None:
        start = process_start_time(pid)
        tmp = self.pidfile.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{pid} {start if start is not None else 0}\n")
        tmp.replace(self.pidfile)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():  # e.g. a file created concurrently; one more pass, then report it
            shutil.rmtree(self.root)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses; everything after the last ')' is well-formed.
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_pidfile(vmdir: VmDir) -> int | None:
    """The pid in ``vmdir``'s pidfile if that process is still the QEMU of this directory, else None."""
    try:
        pid_text, start_text = vmdir.pidfile.read_text().split()
        pid, start = int(pid_text), int(start_text)
    except (OSError, ValueError):
        return None
    if process_start_time(pid) != start:
        return None  # gone, or the pid was reused by another process
    return pid if any(str(vmdir.root) in arg for arg in _cmdline(pid)) else None


def find_qemu_pids(under: Path) -> list[int]:
    """Processes whose command line names a path inside ``under`` (QEMU started by a previous node)."""
    needle = str(under).rstrip("/") + "/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if argv and "qemu-system" in os.path.basename(argv[0]) and any(needle in a for a in argv[1:]):
            found.append(int(entry.name))
    return found


def kill_and_wait(pid: int, timeout: float = 5.0) -> bool:
    """SIGKILL a process that is not our child and wait until it is gone; False if it outlived the timeout."""
    start = process_start_time(pid)
    if start is None:
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # A zombie keeps its start time until reaped by its parent, but a zombie holds no resources.
        now = process_start_time(pid)
        if now != start or _is_zombie(pid):
            return True
        time.sleep(0.02)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].startswith("Z")


def vm_uids_in_use(state_vms: Path) -> set[int]:
    """The owners of every VM directory's run/ folder (VMs of this or a previous node process)."""
    used = set()
    if state_vms.is_dir():
        for child in state_vms.iterdir():
            with contextlib.suppress(OSError):
                used.add((child / "run").stat().st_uid)
    return used


def pick_vm_uid(state_vms: Path) -> int:
    """A uid from the VM range not owning any existing VM directory's run/ folder (one-off use; a
    runtime allocates through an :class:`~capsa.node.runtime.ids.IdAllocator` so that two VMs it starts
    at the same moment cannot get the same uid)."""
    used = vm_uids_in_use(state_vms)
    for _ in range(1000):
        uid = VM_UID_BASE + secrets.randbelow(VM_UID_COUNT)
        if uid not in used:
            return uid
    raise RuntimeError("no free VM uid")  # unreachable in practice: 1e6 uids

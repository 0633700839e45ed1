"""Whether QEMU, as the user it runs as, can open /dev/kvm for ``-accel kvm``.

Mode bits alone cannot answer this (the VM user's groups, ACLs, a device cgroup, an LSM), so the device is
opened read-write by a shell started exactly as QEMU is: the same isolation prefix, VM uid, gid and
supplementary groups (:func:`~capsa.node.runtime.qemu.process.isolation_prefix`). Whether the guest then
boots under KVM (a PVM /dev/kvm opens fine and cannot boot stock kernels) is only known by booting it.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from pathlib import Path

from capsa.node.runtime.qemu.process import QemuProcessError, isolation_prefix

__all__ = ["KVM_DEVICE", "describe_device", "describe_user", "kvm_access_error", "kvm_groups"]

KVM_DEVICE = Path("/dev/kvm")
"""The device QEMU opens for ``-accel kvm`` (QEMU 7.2 has no option to name another)."""

_OPEN_RW = 'exec 3<>"$1"'  # the path is checked to be a character device first, so nothing is created
_TIMEOUT = 10.0


def kvm_groups(device: Path = KVM_DEVICE) -> tuple[int, ...]:
    """The supplementary groups a VM on KVM gets: the device's group, unless it is root's."""
    try:
        gid = device.stat().st_gid
    except OSError:
        return ()
    return (gid,) if gid != 0 else ()


def describe_device(device: Path = KVM_DEVICE) -> str:
    """``/dev/kvm (mode 0660, owner 0:993)``, for messages."""
    try:
        st = device.stat()
    except OSError as exc:
        return f"{device} ({exc.strerror})"
    return f"{device} (mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}:{st.st_gid})"


def describe_user(user: tuple[int, int] | None, groups: tuple[int, ...]) -> str:
    """Who QEMU runs as: ``the VM user 1879048192 (groups: 993)``."""
    who = f"the VM user {user[0]}" if user is not None else f"this process's user {os.geteuid()}"
    return f"{who} (groups: {','.join(str(g) for g in groups) or 'none'})"


def _not_a_device(device: Path) -> str | None:
    try:
        st = device.stat()
    except FileNotFoundError:
        return f"{device} does not exist"
    except OSError as exc:
        return f"{device}: {exc.strerror}"
    return None if stat.S_ISCHR(st.st_mode) else f"{describe_device(device)} is not a character device"


async def kvm_access_error(user: tuple[int, int] | None, groups: tuple[int, ...] = (),
                           device: Path = KVM_DEVICE) -> str | None:
    """None when QEMU running as ``user`` (uid, gid; None: this process's user) with exactly the
    supplementary ``groups`` can open ``device`` read-write; else why not, naming the device, its mode and
    owner, and the user."""
    problem = _not_a_device(device)
    if problem is not None:
        return problem
    try:
        argv = [*isolation_prefix(user, groups), "/bin/sh", "-c", _OPEN_RW, "sh", str(device)]
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE, cwd="/")
    except (OSError, QemuProcessError) as exc:
        return f"cannot check {device} as {describe_user(user, groups)}: {exc}"
    try:
        async with asyncio.timeout(_TIMEOUT):
            _, err = await proc.communicate()
    except TimeoutError:
        return f"opening {device} as {describe_user(user, groups)} took over {_TIMEOUT:g}s"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode == 0:
        return None
    lines = err.decode(errors="replace").strip().splitlines()
    why = lines[-1].rsplit(": ", 1)[-1] if lines else f"exit status {proc.returncode}"
    return f"{describe_device(device)} is not accessible to {describe_user(user, groups)}: {why}"

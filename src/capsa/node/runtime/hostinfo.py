"""Facts about the host that the QEMU command line depends on (TSC rate, QEMU version, kernel release).

Whether QEMU can use /dev/kvm is checked as the VM user, in :mod:`capsa.node.runtime.qemu.kvm`.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "HostInfoError",
    "host_kernel_release",
    "qemu_binary",
    "qemu_version",
    "tsc_khz",
]

_QEMU_NAME = "qemu-system-x86_64"


class HostInfoError(Exception):
    """The host lacks something QEMU needs (binary missing, unreadable version)."""


@functools.cache
def qemu_binary() -> str:
    found = shutil.which(_QEMU_NAME)
    if found is None:
        raise HostInfoError(f"{_QEMU_NAME} not found on PATH (install Debian's qemu-system-x86)")
    return found


@functools.cache
def qemu_version(binary: str | None = None) -> str:
    exe = binary or qemu_binary()
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False)
    match = re.search(r"version (\S+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise HostInfoError(f"cannot read the version of {exe}: {out.stderr.strip() or out.stdout.strip()}")
    return match.group(1)


def host_kernel_release() -> str:
    return os.uname().release


def tsc_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The host TSC rate in kHz, or None when it cannot be found.

    Under TCG the guest kernel cannot calibrate its TSC without a hint (RECIPES.md), so the value is
    passed as ``tsc_early_khz=``. Some kernels export the exact rate in sysfs; otherwise the ``cpu MHz``
    of /proc/cpuinfo is the TSC rate on the virtual machines this project runs on (constant TSC).
    """
    sysfs = Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
    try:
        return int(sysfs.read_text().strip())
    except (OSError, ValueError):
        pass
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    match = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.MULTILINE)
    if match is None:
        return None
    khz = round(float(match.group(1)) * 1000)
    return khz if khz > 0 else None

"""An idle guest in a real microVM does not keep its host busy: init has stopped the legacy PIT (which the
Debian 6.1 kernel leaves running at ~18 Hz in QEMU, waking QEMU's main loop while nothing happens) and set
the sysctls that keep the guest kernel from waking itself (capsa.guest.quiet). Both are kernel state, so a
sandbox restored from a snapshot has them too."""

from __future__ import annotations

import shutil

import pytest

from capsa.guest import quiet
from capsa.node.runtime.qemu import QemuSandbox

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]

# Read-back command for channel 0's status (out 0x43 0xE2; in 0x40): bits 3-1 are its mode.
PIT_STATUS = """
import ctypes, mmap
libc = ctypes.CDLL(None)
assert libc.ioperm(0x40, 4, 1) == 0
code = mmap.mmap(-1, mmap.PAGESIZE, prot=7)
code.write(bytes([0xB0, 0xE2, 0xE6, 0x43, 0xE4, 0x40, 0x0F, 0xB6, 0xC0, 0xC3]))
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))())
"""


async def test_the_pit_is_stopped_and_the_kernel_is_told_to_sleep(sandbox: QemuSandbox) -> None:
    r = await sandbox.guest.exec(["python3", "-c", PIT_STATUS], timeout=60)
    assert r.exit_code == 0, r
    status = int(r.stdout.decode())
    # Mode 0 (interrupt on terminal count, count 0: it fired once, long ago) with lo/hi byte access, as
    # init's stop_pit left it; the reset state a kernel that never touched it leaves is mode 3.
    assert (status >> 1) & 0b111 == 0 and (status >> 4) & 0b11 == 0b11, f"PIT status {status:#04x}"
    names = [name for name, _ in quiet.SYSCTLS]
    r = await sandbox.guest.exec(["cat", *(f"/proc/sys/{name}" for name in names)], timeout=60)
    assert r.exit_code == 0, r
    assert dict(zip(names, r.stdout.decode().split(), strict=True)) == dict(quiet.SYSCTLS)

"""An idle guest that does not wake: what init turns off once at boot so that a sandbox nobody uses costs
its host (nearly) nothing.

Under TCG every guest wakeup costs host CPU, and a node holds hundreds of idle sandboxes. Measured on a
booted ``base`` VM (2026-12-01, 60 s idle windows): QEMU's main loop spent 0.23 s a minute running the
legacy PIT, which the Debian 6.1 kernel leaves in its reset state (channel 0, mode 3, ~18.2 Hz) when the
local APIC timer takes over without the PIT ever becoming a clock event device (kernels from 6.14 stop it
themselves). Inside the guest, kcompactd's proactive compaction check wakes it twice a second, the soft
lockup watchdog every four seconds, and vmstat/writeback work every one to five seconds.

Each step is best effort and is logged by the caller when it fails: a guest that keeps them behaves the
same, only less quietly. Everything here is kernel state, so a snapshot taken after it keeps it.
"""

from __future__ import annotations

import ctypes
import mmap
import platform

__all__ = ["SYSCTLS", "quiet", "set_sysctls", "stop_pit"]

# (path under /proc/sys, value)
SYSCTLS = (
    ("vm/compaction_proactiveness", "0"),  # kcompactd then sleeps until it is asked for work
    ("kernel/watchdog", "0"),  # the soft/hard lockup watchdog's hrtimer (every 4 s)
    ("vm/stat_interval", "10"),  # per-CPU vmstat folding: every 10 s instead of every second
    ("vm/dirty_writeback_centisecs", "1500"),  # periodic writeback every 15 s instead of 5 s
)

PIT_MODE = 0x43
PIT_CH0 = 0x40

# What Linux's own i8253 shutdown does (arch x86, clockevent_i8253_disable): channel 0 to mode 0
# (interrupt on terminal count) with a zero count, so the emulated PIT never fires again. Python
# cannot issue port I/O and this kernel has no /dev/port, so the three ``out`` instructions run as a
# tiny machine-code function: mov al,0x30; out 0x43,al; xor eax,eax; out 0x40,al; out 0x40,al; ret.
_STOP_PIT_X86_64 = bytes([0xB0, 0x30, 0xE6, PIT_MODE, 0x31, 0xC0, 0xE6, PIT_CH0, 0xE6, PIT_CH0, 0xC3])


def stop_pit() -> None:
    """Stop the i8254 PIT's channel 0 (x86-64 only; needs CAP_SYS_RAWIO for ioperm). Raises OSError."""
    if platform.machine() != "x86_64":
        raise OSError("no PIT on this architecture")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ioperm(ctypes.c_ulong(PIT_CH0), ctypes.c_ulong(PIT_MODE - PIT_CH0 + 1), ctypes.c_int(1)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ioperm: {ctypes.cast(libc.strerror(errno), ctypes.c_char_p).value!r}")
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        code.write(_STOP_PIT_X86_64)
        address = ctypes.addressof(ctypes.c_char.from_buffer(code))
        ctypes.CFUNCTYPE(None)(address)()
    finally:
        # Drop our port access again (the daemon and user commands fork from init, and inherit none of
        # it anyway: ioperm bits are not inherited across fork).
        libc.ioperm(ctypes.c_ulong(PIT_CH0), ctypes.c_ulong(PIT_MODE - PIT_CH0 + 1), ctypes.c_int(0))
        code.close()  # the c_char view above was a temporary: no export is left to block this


def set_sysctls(root: str = "/proc/sys") -> list[str]:
    """Write :data:`SYSCTLS`; returns the ones that could not be set (a kernel without them)."""
    failed = []
    for name, value in SYSCTLS:
        try:
            with open(f"{root}/{name}", "w") as f:
                f.write(value)
        except OSError:
            failed.append(name)
    return failed


def quiet() -> list[str]:
    """Everything above; returns a line per step that failed."""
    problems = [f"sysctl {name} not set" for name in set_sysctls()]
    try:
        stop_pit()
    except OSError as exc:
        problems.append(f"PIT left running: {exc}")
    return problems

"""The QEMU microvm runtime: one runtime class, one sandbox class, one launch path, pluggable storage."""

from capsa.node.runtime.qemu.network import configure_guest_network
from capsa.node.runtime.qemu.runtime import QemuRuntime
from capsa.node.runtime.qemu.sandbox import QemuSandbox
from capsa.node.runtime.qemu.storage import PoolStorage, VmFiles, VmStorage, WorkdirStorage

__all__ = [
    "PoolStorage",
    "QemuRuntime",
    "QemuSandbox",
    "VmFiles",
    "VmStorage",
    "WorkdirStorage",
    "configure_guest_network",
]

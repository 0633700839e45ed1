"""A private copy of the /dev/kvm device node, with the owner and mode a test needs.

Tests about who may open the KVM device point the runtime (``QemuRuntime(kvm_device=...)``) at such a copy,
so they mean the same on a host whose /dev/kvm is 0600, 0660 root:kvm or 0666. Needs root (mknod, chown).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["kvm_node_copy"]

_KVM_RDEV = os.makedev(10, 232)  # the misc device number Linux gives /dev/kvm


def kvm_node_copy(directory: Path, mode: int, *, gid: int = 0, name: str = "kvm") -> Path:
    """A character device ``directory/name`` for the KVM device, owned by root:``gid`` with ``mode``."""
    try:
        rdev = os.stat("/dev/kvm").st_rdev
    except FileNotFoundError:
        rdev = _KVM_RDEV
    path = directory / name
    os.mknod(path, stat.S_IFCHR | 0o600, rdev)
    os.chown(path, 0, gid)
    os.chmod(path, mode)
    return path

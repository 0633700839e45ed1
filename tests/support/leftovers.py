"""What a node (``capsa serve``, ``capsa node``, a test's agent) may leave on the host, found from /proc, /sys
and the state directory, so a test can assert that nothing is left.

Two levels:

- :func:`vm_leftovers` holds while the node still runs: no QEMU process and no VM working directory of a
  closed sandbox (with a warm pool of size 0).
- :func:`node_leftovers` holds once the node has stopped: the above, plus no mount under the state
  directory, no loop device backed by a file in it (the btrfs pool image), no sandbox directory in the
  storage pool, no temporary file in the state directory, and no network namespace or tap with the node's
  prefix.

Each item found is one human-readable line ("qemu pid 123", "mount /x/storage/pool (btrfs)", ...).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from capsa.node.storage.mounts import mounts
from tests.support.processes import qemu_pids

__all__ = [
    "links_with",
    "loop_devices_under",
    "mounts_under",
    "netns_with",
    "node_leftovers",
    "node_netns_prefix",
    "pool_sandbox_dirs",
    "temp_files",
    "vm_leftovers",
    "wait_for_nothing",
    "wait_no_node_leftovers",
    "wait_no_vm_leftovers",
]

# Where the storage pool keeps per-sandbox files: the btrfs mount, or the plain-directory fallback.
_POOL_ROOTS = (Path("storage") / "pool", Path("storage") / "plain")


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def node_netns_prefix(state_dir: Path) -> str:
    """The namespace prefix a node with this state directory gives its sandboxes."""
    from capsa.node.assembly import netns_prefix  # imported late: it pulls in the whole node

    return netns_prefix(state_dir.resolve())


def mounts_under(state_dir: Path) -> list[str]:
    """Mount points at or under ``state_dir`` in this mount namespace."""
    root = state_dir.resolve()
    return [f"mount {m.mount_point} ({m.fstype})" for m in mounts() if _within(m.mount_point, root)]


def loop_devices_under(state_dir: Path) -> list[str]:
    """Loop devices whose backing file lies under ``state_dir`` (the btrfs pool image)."""
    root = state_dir.resolve()
    found = []
    for backing in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        try:
            text = backing.read_text().strip()
        except OSError:
            continue  # detached meanwhile
        target = Path(text.removesuffix(" (deleted)"))
        if _within(target, root):
            found.append(f"loop device /dev/{backing.parent.parent.name} -> {text}")
    return found


def netns_with(prefix: str) -> list[str]:
    """Named network namespaces (``ip netns``) whose name starts with ``prefix``."""
    run = Path("/run/netns")
    names = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    return [f"netns {n}" for n in names if n.startswith(prefix)]


def links_with(prefix: str) -> list[str]:
    """Network interfaces (taps, veths) in the host namespace whose name starts with ``prefix``."""
    return [f"link {n}" for n in sorted(os.listdir("/sys/class/net")) if n.startswith(prefix)]


def pool_sandbox_dirs(state_dir: Path) -> list[str]:
    """Per-sandbox directories (disk, RAM file) in the storage pool, when the pool is visible (mounted,
    or the plain fallback)."""
    found = []
    for root in _POOL_ROOTS:
        sandboxes = state_dir / root / "sandboxes"
        if sandboxes.is_dir():
            found += [f"sandbox dir {p}" for p in sorted(sandboxes.iterdir())]
    return found


def temp_files(state_dir: Path) -> list[str]:
    """Half-written files anywhere under ``state_dir``: ``*.tmp`` and the pool's ``.<name>.tmp-<hex>``."""
    if not state_dir.is_dir():
        return []
    return [f"temp file {p}" for p in sorted(state_dir.rglob("*"))
            if p.name.endswith(".tmp") or ".tmp-" in p.name]


def _vm_dirs(state_dir: Path) -> list[str]:
    vms = state_dir / "vms"
    return [f"vm dir {p}" for p in sorted(vms.iterdir())] if vms.is_dir() else []


def vm_leftovers(state_dir: Path) -> list[str]:
    """QEMU processes that mention ``state_dir`` and VM working directories under ``state_dir/vms``."""
    return [f"qemu pid {pid}" for pid in qemu_pids(state_dir)] + _vm_dirs(state_dir)


def node_leftovers(state_dir: Path, *, netns_prefix: str | None = None,
                   link_prefix: str | None = None) -> list[str]:
    """Everything a stopped node must not leave behind. ``netns_prefix`` defaults to the node's own
    (:func:`node_netns_prefix`); ``link_prefix`` (taps or veths in the host namespace) is checked only when
    given, since sandbox taps live inside their namespaces."""
    prefix = node_netns_prefix(state_dir) if netns_prefix is None else netns_prefix
    found = vm_leftovers(state_dir) + mounts_under(state_dir) + loop_devices_under(state_dir)
    found += pool_sandbox_dirs(state_dir) + temp_files(state_dir) + netns_with(prefix)
    if link_prefix is not None:
        found += links_with(link_prefix)
    return found


def wait_for_nothing(check: Callable[[], list[str]], timeout: float = 30.0,
                     interval: float = 0.5) -> list[str]:
    """Poll ``check`` until it finds nothing or ``timeout`` passes; returns what it found last."""
    deadline = time.monotonic() + timeout
    while (left := check()) and time.monotonic() < deadline:
        time.sleep(interval)
    return left


def wait_no_vm_leftovers(state_dir: Path, timeout: float = 30.0) -> list[str]:
    """:func:`vm_leftovers`, waited for (a closed sandbox's QEMU takes a moment to exit)."""
    return wait_for_nothing(lambda: vm_leftovers(state_dir), timeout)


def wait_no_node_leftovers(state_dir: Path, timeout: float = 30.0, *, netns_prefix: str | None = None,
                           link_prefix: str | None = None) -> list[str]:
    """:func:`node_leftovers`, waited for."""
    return wait_for_nothing(
        lambda: node_leftovers(state_dir, netns_prefix=netns_prefix, link_prefix=link_prefix), timeout)

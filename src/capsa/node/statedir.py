"""Checking, at start-up, that a node's state directory is one its VMs can use (and that no one else can
list or write it).

QEMU runs as an unprivileged per-VM uid (when the node runs as root) and opens its disk, RAM file and sockets
inside the state directory, so every directory from ``/`` down to it must be searchable by other users. A
directory made by ``mktemp -d`` (mode 0700) is not: without this check the node would start, report ready
and then fail every create with an internal error whose reason is only in the log.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from capsa.common.errors import CapsaError

__all__ = ["StateDirError", "check_state_dir", "prepare_state_dir", "unsearchable_ancestor"]


class StateDirError(CapsaError):
    code = "state_dir_unusable"
    status = 500


def prepare_state_dir(state_dir: Path, *, vm_uids: bool | None = None) -> Path:
    """Create ``state_dir`` if needed and check it (see :func:`check_state_dir`); returns it resolved."""
    state_dir = state_dir.resolve()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"cannot use state directory {state_dir}: {exc.strerror}") from exc
    _restrict(state_dir)
    check_state_dir(state_dir, vm_uids=vm_uids)
    return state_dir


def _restrict(state_dir: Path) -> None:
    """No one else may list or write the state directory: it stays searchable (QEMU, as another uid,
    opens its own files in it by name) but loses group and other read and write."""
    st = state_dir.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o066:
        state_dir.chmod(stat.S_IMODE(st.st_mode) & ~0o066)


def unsearchable_ancestor(path: Path) -> Path | None:
    """The first of ``path`` and its parents that other users cannot search (no o+x), or None."""
    for p in (path, *path.parents):
        if not p.stat().st_mode & stat.S_IXOTH:
            return p
    return None


def check_state_dir(state_dir: Path, *, vm_uids: bool | None = None) -> None:
    """Raise :class:`StateDirError` with a one-line reason if VMs could not use ``state_dir``.

    ``vm_uids``: whether VMs run as other uids (default: when running as root, as the QEMU runtime does).
    """
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise StateDirError(f"state directory {state_dir} is not writable by this process")
    if vm_uids is None:
        vm_uids = os.geteuid() == 0
    if not vm_uids:
        return
    path = unsearchable_ancestor(state_dir)
    if path is not None:
        mode = stat.S_IMODE(path.stat().st_mode)
        raise StateDirError(
            f"state directory {state_dir} cannot be used: {path} (mode {mode:04o}) "
            f"is not searchable by the sandboxes' VM users; run `chmod o+x {path}` or choose another "
            "--state-dir")

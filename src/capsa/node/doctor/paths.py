"""Checks of the state directory: every directory down to it searchable by the user QEMU runs as (tested as
that user, so modes, ACLs and LSMs all count), and free space where the storage pool lives."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from capsa.node.doctor.report import Check, DoctorConfig, run_command, vm_user
from capsa.node.runtime.qemu.process import QemuProcessError, isolation_prefix
from capsa.node.storage.floor import MiB

__all__ = ["HEADROOM_MIB", "disk_space", "state_dir"]

HEADROOM_MIB = 1024
"""Free space asked for beyond the pool's floor (``CAPSA_STORAGE_MIN_FREE_MIB``): below the floor every
snapshot, pause and restore is refused (``storage_full``), so a host just above it could not do much."""

# Prints the first argument the user running it cannot search, and exits 3.
_FIRST_UNSEARCHABLE = 'for p; do [ -x "$p" ] || { printf %s "$p"; exit 3; }; done'


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (what a node would make the state dir in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _describe(path: Path) -> str:
    try:
        st = path.stat()
    except OSError as exc:
        return f"{path} ({exc.strerror})"
    return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}:{st.st_gid})"


async def state_dir(cfg: DoctorConfig) -> Check:
    """The node can write the state dir (or make it), and the VM user can search every directory from
    ``/`` down to it: QEMU opens its disk, RAM file and sockets in it by name."""
    name = "state_dir"
    target = cfg.state_dir
    existing = _existing(target)
    what = f"{target}" if existing == target else f"{target} (to be made in {existing})"
    if not existing.is_dir():
        return Check(name, False, f"{_describe(existing)} is not a directory",
                     "choose another --state-dir (CAPSA_STATE_DIR)")
    if not os.access(existing, os.W_OK | os.X_OK):
        return Check(name, False, f"{_describe(existing)} is not writable by this process (uid "
                                  f"{os.geteuid()})", f"run the node as root, or chown {existing}")
    user = vm_user()
    if user is None:
        return Check(name, True, f"{what} is writable; QEMU runs as this process's user, so no other user "
                                 "needs to reach it")
    chain = [str(p) for p in (*reversed(existing.parents), existing)]
    try:
        prefix = isolation_prefix(user, ())
    except QemuProcessError as exc:
        return Check(name, False, str(exc), "apt-get install util-linux")
    code, out = await run_command([*prefix, "/bin/sh", "-c", _FIRST_UNSEARCHABLE, "sh", *chain])
    if code == 3:
        blocked = Path(out)
        return Check(name, False, f"{_describe(blocked)} is not searchable by the VM user {user[0]}: QEMU "
                                  f"could not reach its files under {target}",
                     f"chmod o+x {blocked}, or choose a --state-dir (CAPSA_STATE_DIR) whose parents are all "
                     "searchable")
    if code != 0:
        return Check(name, False, f"cannot check {target} as the VM user {user[0]}: {out}",
                     "run the node as root")
    return Check(name, True, f"{what} is writable, and every directory from / down to {existing} is "
                             f"searchable by the VM user {user[0]}")


async def disk_space(cfg: DoctorConfig) -> Check:
    """Free space where the storage pool lives (``CAPSA_STORAGE_PATH``, else the state dir, whose loop file
    is sparse and grows into it): the pool's floor plus :data:`HEADROOM_MIB`."""
    where = cfg.storage.path if cfg.storage.path is not None else _existing(cfg.state_dir)
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return Check("disk_space", False, f"cannot read the free space of {where}: {exc.strerror}",
                     "choose another --state-dir (CAPSA_STATE_DIR)")
    floor = cfg.storage.min_free_mib
    need = floor + HEADROOM_MIB
    found = f"{free / 1024 / MiB:.1f} GiB free on the filesystem of {where}"
    if free < need * MiB:
        return Check("disk_space", False, f"{found}; the node needs {need} MiB (its pool keeps "
                                          f"CAPSA_STORAGE_MIN_FREE_MIB={floor} free, plus {HEADROOM_MIB} "
                                          "to work in)",
                     "free space there, or put the state dir (or CAPSA_STORAGE_PATH) on a larger filesystem")
    return Check("disk_space", True, f"{found} (needs {need} MiB: the pool's floor "
                                     f"CAPSA_STORAGE_MIN_FREE_MIB={floor} plus {HEADROOM_MIB})")

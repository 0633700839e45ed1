"""Sealed RAM memfds from outside: which a process holds, and what a process of another uid can do to one
or to a frozen RAM file (run as a child under ``setpriv`` as that uid, the QEMU's, it tries every way to
write and prints one line per attempt)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["MEMFD_PREFIX", "assert_qemu_cannot_write", "attack_as", "ram_memfd_mapping", "ram_memfds"]

MEMFD_PREFIX = "/memfd:capsa-ram"
"""How ``/proc/PID/fd`` and ``/proc/PID/smaps`` name a sealed RAM memfd."""


def ram_memfds(pid: int | str = "self") -> dict[int, Path]:
    """The sealed RAM memfds process ``pid`` holds: descriptor number -> its ``/proc/PID/fd/N`` path."""
    found = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile (the listing's own descriptor)
            if os.readlink(fd).startswith(MEMFD_PREFIX):
                found[int(fd.name)] = fd
    return found


def ram_memfd_mapping(pid: int) -> tuple[int, dict[str, int]]:
    """(inode, smaps fields in KiB summed over its mappings) of the sealed RAM memfd QEMU ``pid`` maps."""
    inodes: set[int] = set()
    fields: dict[str, int] = {}
    mine = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):  # a mapping's header: range perms offset dev inode [name]
            mine = len(parts) > 5 and parts[5].startswith(MEMFD_PREFIX)
            if mine:
                inodes.add(int(parts[4]))
        elif mine and line.endswith(" kB"):
            fields[parts[0][:-1]] = fields.get(parts[0][:-1], 0) + int(parts[1])
    assert len(inodes) == 1, f"QEMU {pid} maps sealed RAM memfds {inodes}"
    return inodes.pop(), fields


_ATTACK = r'''
import ctypes, json, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.strerror or str(exc)
def punch(fd):
    if libc.fallocate(fd, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(4096)) != 0:  # KEEP_SIZE|PUNCH_HOLE
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        out[path] = {"open": exc.strerror}
        continue
    out = {}
    attempt("write", lambda: os.pwrite(fd, b"poison", 0))
    attempt("truncate", lambda: os.ftruncate(fd, 0))
    attempt("punch", lambda: punch(fd))
    attempt("shared_map", lambda: mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED,
                                            prot=mmap.PROT_READ | mmap.PROT_WRITE))
    out = {path: {"open": "ok", **out}}
    print(json.dumps(out)); sys.exit(0)
print(json.dumps(out))
'''


def attack_as(uid: int, gid: int, *paths: Path | str) -> dict[str, dict[str, str]]:
    """For each path: {"open": "ok" | why not, and when it opened read-write: "write", "truncate", "punch",
    "shared_map" -> "ok" | why not}, tried by a process of ``uid``/``gid`` with no supplementary groups."""
    results: dict[str, dict[str, str]] = {}
    for path in paths:
        proc = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                               "--no-new-privs", "--", sys.executable, "-c", _ATTACK, str(path)],
                              capture_output=True, text=True, timeout=60, check=True)
        results.update(json.loads(proc.stdout))
    return results


def assert_qemu_cannot_write(pid: int, uid: int, ram: Path) -> None:
    """As QEMU ``pid``'s ``uid``: the frozen RAM file ``ram`` cannot be opened, and each sealed memfd
    descriptor QEMU holds (the inherited one and its own reopening) opens read-write but takes no write,
    truncation, hole punch or writable shared mapping."""
    fds = list(ram_memfds(pid).values())
    assert fds, f"QEMU {pid} holds no sealed RAM memfd"
    got = attack_as(uid, uid, ram, *fds)
    assert got[str(ram)] == {"open": "Permission denied"}, got
    refused = "Operation not permitted"
    for fd in fds:
        assert got[str(fd)] == {"open": "ok", "write": refused, "truncate": refused, "punch": refused,
                                "shared_map": refused}, got

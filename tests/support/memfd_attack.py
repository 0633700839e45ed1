"""What a process of another uid can do to a sealed RAM memfd or a frozen RAM file: run as a child under
``setpriv`` as that uid (the QEMU's), it tries every way to write and prints one line per attempt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["attack_as"]

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

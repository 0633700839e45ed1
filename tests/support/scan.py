"""Searching where a secret's bytes could hide: a process's memory (the guest's RAM is a mapping of its
QEMU process) and files (the VM's disk image)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["file_contains", "memory_contains"]

_CHUNK = 16 << 20


def memory_contains(pid: int, needle: bytes) -> bool:
    """Whether any readable mapping of process ``pid`` holds ``needle`` (needs ptrace rights: root)."""
    found = False
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if m is None or m.group(3)[0] != "r":
                continue
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            pos = start
            tail = b""
            while pos < end:
                size = min(_CHUNK, end - pos)
                try:
                    mem.seek(pos)
                    chunk = mem.read(size)
                except OSError:
                    break
                if needle in tail + chunk:
                    found = True
                tail = chunk[-len(needle):]
                pos += size
    return found


def file_contains(path: Path, needle: bytes) -> bool:
    """Whether the file at ``path`` holds ``needle`` (read in chunks; matches across chunk borders)."""
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(_CHUNK):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle):]
    return False

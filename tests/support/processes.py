"""Host processes seen from /proc (``ps`` truncates command lines): by a marker, or QEMU under a directory."""

from __future__ import annotations

from pathlib import Path

__all__ = ["processes_with", "qemu_pids"]


def _cmdlines() -> list[tuple[int, list[bytes]]]:
    found: list[tuple[int, list[bytes]]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found.append((int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")))
        except OSError:
            continue  # exited meanwhile
    return found


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    needle = marker.encode()
    return [pid for pid, args in _cmdlines() if needle in b"\0".join(args)]


def qemu_pids(path: Path) -> list[int]:
    """QEMU processes whose command line mentions ``path`` (a state or work directory)."""
    needle = str(path).encode()
    return [pid for pid, args in _cmdlines()
            if args and b"qemu-system" in args[0] and any(needle in a for a in args)]

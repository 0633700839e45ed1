"""A memory cgroup with a limit for a process under test (a node whose pod or unit has a memory limit).

cgroup v2 when the host has it (a child of the root, where the memory controller is enabled), else the v1
memory hierarchy. :attr:`MemoryCgroup.prefix` runs a command inside it (see ``tests.support.served.spawn``);
:meth:`MemoryCgroup.oom_kills` counts the OOM killer's kills in it.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCgroup", "memory_cgroup"]

_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    v2: bool

    @property
    def prefix(self) -> list[str]:
        """A command prefix that moves the command into this cgroup before it runs."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def oom_kills(self) -> int:
        events = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise AssertionError(f"{events} has no oom_kill count")


@contextlib.contextmanager
def memory_cgroup(limit_mib: int) -> Iterator[MemoryCgroup]:
    """A fresh cgroup limited to ``limit_mib`` (no swap beyond it); removed afterwards, once its processes
    are gone."""
    controllers = _ROOT / "cgroup.subtree_control"
    v2 = controllers.exists() and "memory" in controllers.read_text().split()
    base = _ROOT if v2 else _ROOT / "memory"
    path = base / f"capsa-test-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        if v2:
            (path / "memory.max").write_text(str(limit_mib << 20))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
        yield MemoryCgroup(path, v2)
    finally:
        deadline = time.monotonic() + 30
        while (path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.2)
        path.rmdir()

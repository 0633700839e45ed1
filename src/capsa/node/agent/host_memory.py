"""Admission by the memory the host really has, not by the guest sizes sandboxes declare.

Declared guest memory says little about what a sandbox costs: a restored, idle 256 MiB guest uses what it
dirtied plus QEMU's own memory, and sandboxes of one template may share pages. So besides the declared
budget of :mod:`.capacity` (an operator's overcommit bound), the node admits a sandbox only while the memory
left to it, minus what the sandboxes being made will take, stays above a reserve. A refusal is the agent's
``no_capacity`` error, not the OOM killer later.

*The memory left* is the smaller of the host's ``MemAvailable`` and, for every memory cgroup limit above the
node's process (a Kubernetes pod's limit, systemd's ``MemoryMax=``), the limit minus its working set (usage
minus inactive file pages, as kubelet counts for eviction). Both cgroup versions are read. Either figure
counts page cache as memory to be had, but a sandbox whose guest RAM is a shared file mapping (its own copy
of the template's RAM) holds that RAM as page cache: reclaiming it would write the guest's memory out and
thrash, so the sandboxes' file-backed PSS (``Pss_File``) is taken off what page cache counts for (found by
``tests/integration/test_memory_admission_vm.py``: without it an idle guest's inactive RAM pages were
counted free, the node admitted past its limit and guests stalled in reclaim).

*What a sandbox takes* is the mean of the live sandboxes' highest PSS (``/proc/<pid>/smaps_rollup``,
measured at most every :data:`MEASURE_EVERY` seconds; see :meth:`MemoryGuard.reading`); before any is
measured, the declared size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MEASURE_EVERY", "MemoryGuard", "MemoryReading", "available_mib", "pss_mib"]

MEASURE_EVERY = 5.0
_MIB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemoryReading:
    """What the host (or the tightest cgroup limit above the node) still has for new sandboxes, and the PSS
    (and its file-backed part) of the ``measured`` live sandboxes, each at its highest (see
    :meth:`MemoryGuard.reading`)."""

    available_mib: int
    pss_mib: float
    file_mib: float
    measured: int

    def per_sandbox_mib(self, declared_mib: int) -> int:
        """What one more sandbox is expected to take: the live ones' mean PSS, or ``declared_mib`` before
        any runs."""
        return max(1, round(self.pss_mib / self.measured)) if self.measured else declared_mib


def _field(text: str, key: str) -> int | None:
    """The number after ``key`` on the line it starts (/proc and cgroup key-value files); None if absent."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == key:
            return int(fields[1])
    return None


def _meminfo_available(root: Path) -> int:
    kib = _field((root / "proc/meminfo").read_text(), "MemAvailable:")
    if kib is None:
        raise RuntimeError("/proc/meminfo has no MemAvailable")
    return kib * 1024


def _cgroup_headroom(root: Path, pid: int | str, held_file: int) -> int | None:
    """The least ``limit - working set`` over the memory cgroups of ``pid`` and their ancestors (bytes),
    ``held_file`` bytes of the inactive file pages counted in use; None when none is limited."""
    best: int | None = None
    for line in (root / f"proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, files = root / "sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory hierarchy
            base = root / "sys/fs/cgroup/memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = base.joinpath(*parts[:depth])
            try:
                raw = (directory / files[0]).read_text().strip()
                if raw == "max" or int(raw) >= _UNLIMITED:
                    continue
                usage = int((directory / files[1]).read_text())
                inactive = _field((directory / "memory.stat").read_text(), files[2]) or 0
            except (OSError, ValueError):
                continue
            headroom = int(raw) - usage + max(0, inactive - held_file)
            best = headroom if best is None else min(best, headroom)
    return best


def available_mib(held_file_mib: float = 0, root: Path = Path("/"), pid: int | str = "self") -> int:
    """The memory left for new sandboxes on this host, in MiB, ``held_file_mib`` of page cache being the
    sandboxes' own memory (see the module's docstring)."""
    held = int(held_file_mib * _MIB)
    available = _meminfo_available(root) - held
    headroom = _cgroup_headroom(root, pid, held)
    if headroom is not None:
        available = min(available, headroom)
    return max(0, available) // _MIB


def pss_mib(pid: int, root: Path = Path("/")) -> tuple[float, float] | None:
    """The PSS of process ``pid`` in MiB, and the file-backed part of it (None if it is gone)."""
    try:
        text = (root / f"proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    return (_field(text, "Pss:") or 0) / 1024, (_field(text, "Pss_File:") or 0) / 1024


class MemoryGuard:
    """Refuses a sandbox when the memory left, less what the sandboxes being made take, would fall under
    ``reserve_mib``.

    ``pids`` gives the processes of the live sandboxes (for the per-sandbox figure); ``available`` reads the
    memory left given the sandboxes' file-backed PSS (tests give a fixed one)."""

    def __init__(self, reserve_mib: int, pids: Callable[[], Iterable[int]],
                 available: Callable[[float], int] = available_mib,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reserve_mib = reserve_mib
        self._pids = pids
        self._available = available
        self._clock = clock
        self._peaks: dict[int, tuple[float, float]] = {}  # pid -> the highest PSS and file part seen (MiB)
        self._measured_at = float("-inf")

    def reading(self) -> MemoryReading:
        """The memory left now, and the live sandboxes' PSS, each at the highest seen: a guest's RAM pages
        the kernel wrote back to its file still count, since the guest will want them again (with 450 idle
        sessions on this 24 GiB host the current figure fell to 1.2 MiB of guest RAM each and `true` took
        2.6x as long). Measured every :data:`MEASURE_EVERY` seconds at most (or as soon as the first
        sandbox runs); a sandbox not measured yet counts as the mean of those that were."""
        now, pids = self._clock(), list(self._pids())
        if now - self._measured_at >= MEASURE_EVERY or (pids and not self._peaks):
            self._measured_at = now
            peaks = {}
            for pid in pids:
                figure = pss_mib(pid)
                if figure is not None:
                    high = self._peaks.get(pid, (0.0, 0.0))
                    peaks[pid] = (max(high[0], figure[0]), max(high[1], figure[1]))
            self._peaks = peaks
        known = [self._peaks[pid] for pid in pids if pid in self._peaks]
        if not known:
            return MemoryReading(self._available(0.0), 0.0, 0.0, 0)
        scale = len(pids) / len(known)
        pss, file = sum(p for p, _ in known) * scale, sum(f for _, f in known) * scale
        return MemoryReading(self._available(file), pss, file, len(pids))

    def refusal(self, n: int, declared_mib: int, making: int) -> str | None:
        """Why ``n`` more sandboxes of ``declared_mib`` cannot be made while ``making`` others are being
        made, or None when they fit."""
        r = self.reading()
        each = r.per_sandbox_mib(declared_mib)
        needed = (n + making) * each
        if r.available_mib - needed >= self.reserve_mib:
            return None
        basis = (f"the mean highest PSS of {r.measured} live sandbox(es)" if r.measured
                 else "its declared memory (none is running to measure)")
        return (f"node is short of memory: {r.available_mib} MiB left, {self.reserve_mib} MiB kept free, and "
                f"{n + making} sandbox(es) to make need about {needed} MiB ({each} MiB each, "
                f"from {basis})")

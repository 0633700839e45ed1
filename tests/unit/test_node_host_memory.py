"""Admission by real memory (capsa.node.agent.host_memory): what is left on the host or under the node's
cgroup limit (v1 and v2, a limit set on an ancestor too), what a sandbox is expected to take (the live
sandboxes' PSS, read from /proc), and the refusal the agent's table gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.agent.capacity import CapacitySettings, NodeCapacity, capacity_for
from capsa.node.agent.host_memory import MEASURE_EVERY, MemoryGuard, available_mib, pss_mib
from capsa.node.agent.sandboxes import SandboxTable

MIB = 1 << 20


def _host(root: Path, available_mib: int, cgroup: str) -> None:
    (root / "proc/42").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 25165824 kB\nMemAvailable: {available_mib * 1024} kB\n")
    (root / "proc/42/cgroup").write_text(cgroup)


def _files(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_without_a_cgroup_limit_the_host_memavailable_counts(tmp_path: Path) -> None:
    _host(tmp_path, 20000, "0::/system.slice/capsa.service\n")
    _files(tmp_path / "sys/fs/cgroup/system.slice/capsa.service",
           {"memory.max": "max\n", "memory.current": str(900 * MIB), "memory.stat": "inactive_file 0\n"})
    assert available_mib(0, tmp_path, 42) == 20000
    assert available_mib(300, tmp_path, 42) == 19700  # the sandboxes' own page cache is not free


def test_a_v2_limit_on_an_ancestor_bounds_what_is_left_by_its_working_set(tmp_path: Path) -> None:
    _host(tmp_path, 20000, "0::/kubepods/pod1/node\n")
    # The pod's limit is 2 GiB; 1.5 GiB in use of which 512 MiB is inactive file cache: 1 GiB working set.
    _files(tmp_path / "sys/fs/cgroup/kubepods/pod1", {
        "memory.max": str(2048 * MIB), "memory.current": str(1536 * MIB),
        "memory.stat": f"anon 1\ninactive_file {512 * MIB}\nactive_file 0\n"})
    _files(tmp_path / "sys/fs/cgroup/kubepods/pod1/node", {
        "memory.max": "max", "memory.current": str(1536 * MIB), "memory.stat": "inactive_file 0\n"})
    assert available_mib(0, tmp_path, 42) == 1024
    assert available_mib(200, tmp_path, 42) == 824  # 200 MiB of the inactive file pages are guest RAM
    assert available_mib(900, tmp_path, 42) == 512  # no more than all of them


def test_a_v1_limit_counts_and_the_host_wins_when_it_has_less(tmp_path: Path) -> None:
    cgroup = "12:pids:/\n4:memory:/capsa\n0::/\n"
    _host(tmp_path, 20000, cgroup)
    _files(tmp_path / "sys/fs/cgroup/memory/capsa", {
        "memory.limit_in_bytes": str(1280 * MIB), "memory.usage_in_bytes": str(700 * MIB),
        "memory.stat": f"cache 5\ntotal_inactive_file {100 * MIB}\n"})
    _files(tmp_path / "sys/fs/cgroup/memory", {"memory.limit_in_bytes": "9223372036854771712"})
    assert available_mib(0, tmp_path, 42) == 1280 - 600
    (tmp_path / "proc/meminfo").write_text("MemAvailable: 102400 kB\n")
    assert available_mib(0, tmp_path, 42) == 100


def test_this_process_reads_without_error() -> None:
    assert available_mib() > 0
    pss = pss_mib(os.getpid())
    assert pss is not None and pss[0] > 1 and 0 < pss[1] < pss[0]  # the interpreter's own file mappings
    assert pss_mib(2**22 + 7) is None  # no such process


def _guard(available: int, pids: list[int]) -> MemoryGuard:
    return MemoryGuard(256, pids=lambda: pids, available=lambda _file: available)


def test_before_any_sandbox_runs_a_new_one_is_expected_to_take_its_declared_memory() -> None:
    assert _guard(256 + 512, []).refusal(2, 256, making=0) is None
    refusal = _guard(256 + 511, []).refusal(2, 256, making=0)
    assert refusal is not None and "declared memory" in refusal and "767 MiB left" in refusal


def test_live_sandboxes_pss_is_the_expectation_and_sandboxes_being_made_count() -> None:
    code = "import sys; b = b'x' * (48 << 20); print('ready', flush=True); sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            guard = _guard(256 + 300, [child.pid])
            reading = guard.reading()
            assert reading.measured == 1 and 48 <= reading.per_sandbox_mib(1024) < 100, reading
            assert guard.refusal(1, 1024, making=0) is None  # measured, not the declared 1 GiB
            refusal = guard.refusal(1, 1024, making=5)
            assert refusal is not None and "6 sandbox(es)" in refusal
            assert "mean highest PSS of 1 live" in refusal
        finally:
            assert child.stdin is not None
            child.stdin.close()


def test_the_table_refuses_with_no_capacity_and_holds_nothing() -> None:
    capacity = NodeCapacity(memory_mib=100_000, vcpus=100, max_sandboxes=100, memory_reserve_mib=256)
    table = SandboxTable(capacity, _guard(256 + 3 * 128, []))
    with table.reserve([new_id("sbx")], 128, 1), table.reserve([new_id("sbx")], 128, 1):
        with pytest.raises(CapsaError) as refused, table.reserve([new_id("sbx"), new_id("sbx")], 128, 1):
            pass
        assert refused.value.code == "no_capacity" and refused.value.status == 503
        assert table.used()["sandboxes"] == 2
    assert table.used()["sandboxes"] == 0


def test_the_reserve_defaults_to_five_percent_of_the_host_at_least_256_mib(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPSA_NODE_MEMORY_RESERVE_MIB", raising=False)
    assert capacity_for(CapacitySettings(), host_memory=24 * 1024, host_cpus=2).memory_reserve_mib == 1228
    assert capacity_for(CapacitySettings(), host_memory=2048, host_cpus=2).memory_reserve_mib == 256


def test_between_measurements_the_figure_follows_the_sandboxes_live_now() -> None:
    pids: list[int] = []
    now = [0.0]
    guard = MemoryGuard(256, pids=lambda: pids, available=lambda file: 10_000 - round(file),
                        clock=lambda: now[0])
    assert guard.reading().measured == 0
    pids.append(os.getpid())  # the first sandbox is measured at once, not MEASURE_EVERY later
    one = guard.reading()
    assert one.measured == 1 and one.pss_mib > 1 and one.file_mib > 0
    pids.extend([os.getpid()] * 2)  # two more within MEASURE_EVERY: scaled from the mean, not re-read
    three = guard.reading()
    assert three.measured == 3 and three.pss_mib == pytest.approx(3 * one.pss_mib)
    assert three.available_mib == 10_000 - round(3 * one.file_mib)


def test_a_sandbox_counts_at_the_highest_pss_it_had() -> None:
    # The kernel may write a file-backed guest's RAM back and drop it: its PSS falls, but the guest will
    # want those pages again, so the guard keeps counting them.
    code = ("import sys; b = b'x' * (48 << 20); print('ready', flush=True); sys.stdin.readline(); del b; "
            "print('freed', flush=True); sys.stdin.read()")
    now = [0.0]
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            guard = MemoryGuard(256, pids=lambda: [child.pid], available=lambda file: 10_000,
                                clock=lambda: now[0])
            high = guard.reading().pss_mib
            assert high > 48
            child.stdin.write("free\n")
            child.stdin.flush()
            assert child.stdout.readline() == "freed\n"
            figure = pss_mib(child.pid)
            assert figure is not None and figure[0] < high - 40  # it really gave the memory back
            now[0] += MEASURE_EVERY
            assert guard.reading().pss_mib == high
        finally:
            child.stdin.close()

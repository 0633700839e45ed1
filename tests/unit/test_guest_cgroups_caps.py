"""The guest's process cap for user commands follows its memory (capsa.guest.cgroups.work_pids_max)."""

from __future__ import annotations

import pytest

from capsa.guest.cgroups import WORK_PIDS_MAX, WORK_PIDS_MIN, work_pids_max


@pytest.mark.parametrize(("mem_mib", "cap"), [
    (64, WORK_PIDS_MIN), (240, 240), (256, 256), (1024, 1024), (8192, WORK_PIDS_MAX), (65536, WORK_PIDS_MAX),
])
def test_one_process_per_mib_within_bounds(mem_mib: int, cap: int) -> None:
    assert work_pids_max(mem_mib * 1024) == cap

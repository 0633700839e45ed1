"""Node capacity: ``CAPSA_NODE_*`` settings, the defaults derived from the host, and what they admit."""

from __future__ import annotations

import contextlib
import os

import pytest
from pydantic import ValidationError

from capsa.common.errors import CapsaError
from capsa.common.ids import new_id
from capsa.node.agent.capacity import (
    MAX_SANDBOXES_CAP,
    CapacitySettings,
    NodeCapacity,
    capacity_for,
    default_capacity,
    host_memory_mib,
)
from capsa.node.agent.sandboxes import SandboxTable

GIB = 1024


def admitted(capacity: NodeCapacity, memory_mib: int, vcpus: int = 1) -> int:
    """How many sandboxes of this size the agent's table admits at once before ``no_capacity``."""
    table = SandboxTable(capacity)
    with contextlib.ExitStack() as held:
        n = 0
        while True:
            try:
                held.enter_context(table.reserve([new_id("sbx")], memory_mib, vcpus))
            except CapsaError as exc:
                assert exc.code == "no_capacity"
                return n
            n += 1
            assert n <= 100_000


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MEMORY_MIB", "MEMORY_OVERCOMMIT", "VCPU_OVERCOMMIT", "MAX_SANDBOXES", "MEMORY_RESERVE_MIB"):
        monkeypatch.delenv(f"CAPSA_NODE_{name}", raising=False)


def test_defaults_declare_room_for_400_idle_256_mib_sessions_on_a_2_core_24_gib_host() -> None:
    cap = capacity_for(CapacitySettings(), host_memory=24 * GIB, host_cpus=2)
    assert admitted(cap, 256) >= 400
    # Memory stays the binding limit for such sessions, not the vCPU count.
    assert cap.vcpus >= cap.memory_mib // 256
    assert cap.max_sandboxes == min(MAX_SANDBOXES_CAP, cap.memory_mib // 64)


def test_defaults_scale_with_the_host_and_the_count_is_capped() -> None:
    small = capacity_for(CapacitySettings(), host_memory=4 * GIB, host_cpus=1)
    big = capacity_for(CapacitySettings(), host_memory=1024 * GIB, host_cpus=64)
    assert small.memory_mib < big.memory_mib and small.vcpus < big.vcpus
    assert big.max_sandboxes == MAX_SANDBOXES_CAP
    assert admitted(small, 256) == small.memory_mib // 256


def test_environment_sets_each_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_NODE_MEMORY_MIB", "2048")
    monkeypatch.setenv("CAPSA_NODE_VCPU_OVERCOMMIT", "1.5")
    monkeypatch.setenv("CAPSA_NODE_MAX_SANDBOXES", "5")
    monkeypatch.setenv("CAPSA_NODE_MEMORY_RESERVE_MIB", "512")
    cap = capacity_for(CapacitySettings(), host_memory=24 * GIB, host_cpus=2)
    assert cap == NodeCapacity(memory_mib=2048, vcpus=3, max_sandboxes=5, memory_reserve_mib=512)
    assert admitted(cap, 256) == 3  # the vCPUs run out first
    assert admitted(cap, 1024, vcpus=0) == 2  # then memory
    assert admitted(NodeCapacity(memory_mib=2048, vcpus=100, max_sandboxes=5), 64) == 5


def test_memory_overcommit_only_applies_to_the_derived_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_NODE_MEMORY_OVERCOMMIT", "1")
    assert capacity_for(CapacitySettings(), host_memory=8 * GIB, host_cpus=2).memory_mib == 6 * GIB
    monkeypatch.setenv("CAPSA_NODE_MEMORY_MIB", "1000")
    assert capacity_for(CapacitySettings(), host_memory=8 * GIB, host_cpus=2).memory_mib == 1000


@pytest.mark.parametrize(("name", "value"), [("MEMORY_MIB", "0"), ("VCPU_OVERCOMMIT", "0"),
                                             ("MAX_SANDBOXES", "-1"), ("MEMORY_OVERCOMMIT", "nan"),
                                             ("MAX_SANDBOXES", "many")])
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"CAPSA_NODE_{name}", value)
    with pytest.raises(ValidationError):
        CapacitySettings()


def test_default_capacity_reads_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_NODE_MAX_SANDBOXES", "7")
    cap = default_capacity()
    assert cap.max_sandboxes == 7
    cpus = os.cpu_count() or 1
    assert cap == capacity_for(CapacitySettings(), host_memory=host_memory_mib(), host_cpus=cpus)

"""How many sandboxes a node takes: its capacity, set by ``CAPSA_NODE_*`` or derived from the host.

The agent admits a sandbox while the sum of the declared guest memory, the vCPUs and the count stay within
:class:`NodeCapacity`, and while the host really has the memory for it (:mod:`.host_memory`: what is
left stays above ``memory_reserve_mib``). Sandboxes are mostly idle agents, restored from a snapshot whose
RAM file they map privately, so a 256 MiB guest costs the host only what it dirties (~70 MiB PSS idle):
the declared defaults therefore overcommit both memory and vCPUs (see :class:`CapacitySettings`), and the
real memory is the bound. Set the variables to admit less on hosts whose guests keep busy or fill their
memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "DEFAULT_MEMORY_OVERCOMMIT",
    "DEFAULT_MEMORY_RESERVE_SHARE",
    "DEFAULT_VCPU_OVERCOMMIT",
    "MAX_SANDBOXES_CAP",
    "MIB_PER_SANDBOX_SLOT",
    "MIN_MEMORY_RESERVE_MIB",
    "CapacitySettings",
    "NodeCapacity",
    "capacity_for",
    "default_capacity",
    "host_memory_mib",
]

DEFAULT_MEMORY_OVERCOMMIT = 8.0
"""Declared guest memory per MiB of the host's usable RAM (3/4 of it). High, because the declared figure is
only the operator's bound: what the host really has is the one that binds (:mod:`.host_memory`). On a 24 GiB
host this declares 144 GiB, 576 sessions of 256 MiB; an idle one takes ~50-80 MiB."""
DEFAULT_MEMORY_RESERVE_SHARE = 0.05
"""The host memory kept free by default (at least :data:`MIN_MEMORY_RESERVE_MIB`)."""
MIN_MEMORY_RESERVE_MIB = 256
DEFAULT_VCPU_OVERCOMMIT = 384.0
"""vCPUs per host CPU: an idle guest uses next to none."""
MIB_PER_SANDBOX_SLOT = 64
"""The default sandbox count is the memory budget divided by this..."""
MAX_SANDBOXES_CAP = 1024
"""...and at most this."""


@dataclass(frozen=True)
class NodeCapacity:
    memory_mib: int
    vcpus: int
    max_sandboxes: int
    memory_reserve_mib: int | None = None
    """Host memory (or memory under the node's cgroup limit) kept free: a sandbox that would take the rest
    is refused. None: admission by the declared figures alone."""

    def as_dict(self) -> dict[str, int]:
        return {"memory_mib": self.memory_mib, "vcpus": self.vcpus, "max_sandboxes": self.max_sandboxes}


class CapacitySettings(BaseSettings):
    """``CAPSA_NODE_MEMORY_MIB``, ``CAPSA_NODE_MEMORY_OVERCOMMIT``, ``CAPSA_NODE_VCPU_OVERCOMMIT`` and
    ``CAPSA_NODE_MAX_SANDBOXES``."""

    model_config = SettingsConfigDict(env_prefix="CAPSA_NODE_", extra="ignore")

    memory_mib: int | None = Field(default=None, ge=64)
    """Guest memory the node's sandboxes may declare in total. Default: 3/4 of the host's RAM times
    ``memory_overcommit``."""
    memory_overcommit: float = Field(default=DEFAULT_MEMORY_OVERCOMMIT, gt=0, le=64)
    """Only used when ``memory_mib`` is not set."""
    vcpu_overcommit: float = Field(default=DEFAULT_VCPU_OVERCOMMIT, gt=0, le=1024)
    """vCPUs per host CPU."""
    max_sandboxes: int | None = Field(default=None, ge=1, le=100_000)
    """Default: the memory budget / 64 MiB, at most 1024."""
    memory_reserve_mib: int | None = Field(default=None, ge=0)
    """Memory the node keeps free on its host (``CAPSA_NODE_MEMORY_RESERVE_MIB``). Default: 5% of the host's
    RAM, at least 256 MiB."""


def host_memory_mib() -> int:
    return (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) >> 20


def capacity_for(settings: CapacitySettings, *, host_memory: int, host_cpus: int) -> NodeCapacity:
    """The capacity ``settings`` give a host with ``host_memory`` MiB of RAM and ``host_cpus`` CPUs."""
    memory = settings.memory_mib
    if memory is None:
        memory = int(host_memory * 3 / 4 * settings.memory_overcommit)
    vcpus = max(1, int(settings.vcpu_overcommit * max(1, host_cpus)))
    count = settings.max_sandboxes
    if count is None:
        count = max(1, min(MAX_SANDBOXES_CAP, memory // MIB_PER_SANDBOX_SLOT))
    reserve = settings.memory_reserve_mib
    if reserve is None:
        reserve = max(MIN_MEMORY_RESERVE_MIB, int(host_memory * DEFAULT_MEMORY_RESERVE_SHARE))
    return NodeCapacity(memory_mib=memory, vcpus=vcpus, max_sandboxes=count, memory_reserve_mib=reserve)


def default_capacity(settings: CapacitySettings | None = None) -> NodeCapacity:
    """This host's capacity from ``CAPSA_NODE_*`` (or ``settings``), the rest derived from the host."""
    return capacity_for(settings if settings is not None else CapacitySettings(),
                        host_memory=host_memory_mib(), host_cpus=os.cpu_count() or 1)

"""The node agent: owns the runtime on one host and the sandboxes the control plane asked for.

It knows nothing about sessions or tenants; it creates and destroys sandboxes by id, reports capacity, and
relays guest operations. The HTTP surface is in :mod:`capsa.node.api`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id
from capsa.node.runtime.base import GuestImage, Runtime, Sandbox, SandboxState, VMSpec

__all__ = ["NodeAgent", "NodeCapacity", "SandboxRecord", "default_capacity"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeCapacity:
    memory_mib: int
    vcpus: int
    max_sandboxes: int

    def as_dict(self) -> dict[str, int]:
        return {"memory_mib": self.memory_mib, "vcpus": self.vcpus, "max_sandboxes": self.max_sandboxes}


def default_capacity() -> NodeCapacity:
    """Three quarters of host RAM, 4 vCPUs per host CPU (guests mostly idle), at most 64 sandboxes."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return NodeCapacity(memory_mib=int(pages * 3 / 4) >> 20, vcpus=4 * (os.cpu_count() or 1),
                        max_sandboxes=64)


@dataclass
class SandboxRecord:
    id: str
    template: str
    memory_mib: int
    vcpus: int
    env: dict[str, str]
    sandbox: Sandbox
    created_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "template": self.template, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "state": str(self.sandbox.state), "failure": self.sandbox.failure,
                "accelerator": str(self.sandbox.accelerator), "created_at": self.created_at}


class NodeAgent:
    def __init__(self, runtime: Runtime, image: GuestImage, *, node_id: str = "local",
                 capacity: NodeCapacity | None = None,
                 templates: Mapping[str, GuestImage] | None = None) -> None:
        self.runtime = runtime
        self.node_id = node_id
        self.capacity = capacity or default_capacity()
        self.templates: dict[str, GuestImage] = {"base": image, **(templates or {})}
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._booting: dict[str, tuple[int, int]] = {}  # id -> (memory, vcpus) reserved while it boots
        self._doomed: set[str] = set()  # destroy asked for while still booting
        self._failed: set[str] = set()

    # -- lifecycle of the agent ------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Remove VMs and workdirs a previous agent process left behind; returns what was removed."""
        removed = await self.runtime.cleanup_orphans()
        if removed:
            log.warning("removed %d orphaned sandbox(es): %s", len(removed), removed)
        return removed

    async def close(self) -> None:
        ids = list(self._sandboxes)
        for sandbox_id in ids:
            await self.destroy(sandbox_id)
        await self.runtime.close()

    # -- capacity ----------------------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        records = list(self._sandboxes.values())
        return {
            "memory_mib": sum(r.memory_mib for r in records) + sum(m for m, _ in self._booting.values()),
            "vcpus": sum(r.vcpus for r in records) + sum(c for _, c in self._booting.values()),
            "sandboxes": len(records) + len(self._booting),
        }

    def failed_sandboxes(self) -> list[str]:
        return sorted(self._failed)

    def info(self) -> dict[str, object]:
        return {"node_id": self.node_id, "runtime": self.runtime.name, "templates": sorted(self.templates),
                "capacity": self.capacity.as_dict(), "used": self.used(),
                "failed_sandboxes": self.failed_sandboxes()}

    # -- sandboxes -----------------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                     env: Mapping[str, str]) -> SandboxRecord:
        if not is_id(sandbox_id, "sbx"):
            raise CapsaError(f"bad sandbox id {sandbox_id!r}", code="bad_request", status=400)
        image = self.templates.get(template)
        if image is None:
            raise CapsaError(f"template {template!r} not on this node", code="template_not_found", status=404)
        if sandbox_id in self._sandboxes or sandbox_id in self._booting:
            raise CapsaError(f"sandbox {sandbox_id} exists", code="already_exists", status=409)
        used = self.used()
        if (used["sandboxes"] >= self.capacity.max_sandboxes
                or used["memory_mib"] + memory_mib > self.capacity.memory_mib
                or used["vcpus"] + vcpus > self.capacity.vcpus):
            raise CapsaError("node is full", code="no_capacity", status=503)
        self._booting[sandbox_id] = (memory_mib, vcpus)
        try:
            spec = VMSpec(image=image, memory_mib=memory_mib, vcpus=vcpus,
                          labels={"sandbox": sandbox_id, "template": template})
            sandbox = await self.runtime.boot(spec, sandbox_id=sandbox_id)
        finally:
            del self._booting[sandbox_id]
        record = SandboxRecord(sandbox_id, template, memory_mib, vcpus, dict(env), sandbox)
        self._sandboxes[sandbox_id] = record
        if sandbox_id in self._doomed:
            await self.destroy(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} was destroyed while it booted", code="sandbox_not_found",
                             status=404)

        def _died(reason: str) -> None:
            log.warning("sandbox %s died: %s", sandbox_id, reason)
            if sandbox_id in self._sandboxes:
                self._failed.add(sandbox_id)

        sandbox.on_failure(_died)
        return record

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The live sandbox; a dead one raises ``sandbox_failed``, an unknown one ``sandbox_not_found``."""
        record = self._sandboxes.get(sandbox_id)
        if record is None:
            raise CapsaError(f"sandbox {sandbox_id} not found", code="sandbox_not_found", status=404)
        if record.sandbox.state == SandboxState.FAILED or sandbox_id in self._failed:
            self._failed.add(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} failed: {record.sandbox.failure or 'VM died'}",
                             code="sandbox_failed", status=409)
        return record

    def list(self) -> list[SandboxRecord]:
        return list(self._sandboxes.values())

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox (idempotent). Returns whether there was something to destroy."""
        if sandbox_id in self._booting:
            self._doomed.add(sandbox_id)
            return True
        record = self._sandboxes.pop(sandbox_id, None)
        self._failed.discard(sandbox_id)
        self._doomed.discard(sandbox_id)
        if record is None:
            return False
        await asyncio.shield(self.runtime.destroy(record.sandbox))
        return True

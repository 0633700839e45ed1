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

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.common.ids import is_id
from capsa.node.egress.node_egress import CA_PATH, NodeEgress, install_ca_script
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
    networked: bool = False
    """True when the sandbox was started with an egress policy (it has a NIC behind the broker)."""
    egress_env: dict[str, str] = field(default_factory=dict)
    """The part of ``env`` that egress put there (proxy settings, secret placeholders)."""

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "template": self.template, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "state": str(self.sandbox.state), "failure": self.sandbox.failure,
                "accelerator": str(self.sandbox.accelerator), "created_at": self.created_at}


class NodeAgent:
    def __init__(self, runtime: Runtime, image: GuestImage, *, node_id: str = "local",
                 capacity: NodeCapacity | None = None,
                 templates: Mapping[str, GuestImage] | None = None,
                 egress: NodeEgress | None = None) -> None:
        self.runtime = runtime
        self.egress = egress
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
        if self.egress is not None:
            removed += await self.egress.cleanup_stale()
        if removed:
            log.warning("removed %d orphaned sandbox(es): %s", len(removed), removed)
        return removed

    async def close(self) -> None:
        ids = list(self._sandboxes)
        for sandbox_id in ids:
            await self.destroy(sandbox_id)
        await self.runtime.close()
        if self.egress is not None:
            await self.egress.close()

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
                     env: Mapping[str, str], *, policy: EgressPolicy | None = None,
                     secrets: Mapping[str, str] | None = None,
                     session_id: str | None = None) -> SandboxRecord:
        """Boot a sandbox. Without ``policy`` it has no NIC at all; with one it gets its own namespace
        behind the egress broker, the broker's CA in its trust store and the placeholders in ``env``."""
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
        if policy is not None and self.egress is None:
            raise CapsaError("this node has no egress service: sessions with a policy cannot run here",
                             code="egress_unavailable", status=503)
        self._booting[sandbox_id] = (memory_mib, vcpus)
        egress_env: dict[str, str] = {}
        try:
            network = None
            if policy is not None and self.egress is not None:
                attached = await self.egress.attach(sandbox_id, policy, secrets or {}, session_id=session_id)
                network, egress_env = attached.net, dict(attached.env)
            try:
                spec = VMSpec(image=image, memory_mib=memory_mib, vcpus=vcpus, network=network,
                              labels={"sandbox": sandbox_id, "template": template})
                sandbox = await self.runtime.boot(spec, sandbox_id=sandbox_id)
                if network is not None:
                    try:
                        await self._install_ca(sandbox, attached.ca_pem)
                    except BaseException:
                        await asyncio.shield(self.runtime.destroy(sandbox))
                        raise
            except BaseException:
                if network is not None and self.egress is not None:
                    await asyncio.shield(self.egress.detach(sandbox_id))
                raise
        finally:
            del self._booting[sandbox_id]
        record = SandboxRecord(sandbox_id, template, memory_mib, vcpus, {**env, **egress_env}, sandbox,
                               networked=network is not None, egress_env=egress_env)
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

    @staticmethod
    async def _install_ca(sandbox: Sandbox, ca_pem: bytes) -> None:
        await sandbox.guest.write_file(CA_PATH, ca_pem, mode=0o644)
        result = await sandbox.guest.exec(install_ca_script(), timeout=60)
        if result.exit_code != 0:
            raise CapsaError(f"could not install the egress CA in the guest: {result.stderr[-300:]!r}",
                             code="egress_setup_failed", status=500)

    async def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                            secrets: Mapping[str, str] | None = None) -> bool:
        """Replace a running sandbox's policy; returns whether its CA was re-issued (and re-installed).

        Placeholders of bindings that stay keep their value; the session env changes for new commands."""
        record = self.get(sandbox_id)
        if not record.networked or self.egress is None:
            raise CapsaError(f"sandbox {sandbox_id} was started without a policy and has no network; "
                             "a policy can only be given when the session is created", code="no_network",
                             status=409)
        update = self.egress.update_policy(sandbox_id, policy, secrets or {})
        if update.ca_reissued:
            await self._install_ca(record.sandbox, update.ca_pem)
        placeholders = self.egress.placeholder_env(sandbox_id)
        proxy = {k: v for k, v in record.egress_env.items() if k.lower() in ("http_proxy", "https_proxy")}
        for key in record.egress_env:
            record.env.pop(key, None)
        record.egress_env = {**proxy, **placeholders}
        record.env.update(record.egress_env)
        return update.ca_reissued

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
        try:
            await asyncio.shield(self.runtime.destroy(record.sandbox))
        finally:
            if record.networked and self.egress is not None:
                await asyncio.shield(self.egress.detach(sandbox_id))
        return True

"""The node agent: owns the runtime on one host and the sandboxes the control plane asked for.

It knows nothing about sessions or tenants; it creates and destroys sandboxes by id, reports capacity, and
hands out a sandbox's guest (:class:`~capsa.node.agent.guest.SandboxGuest`). The HTTP surface is in
:mod:`capsa.node.api`.

One class, made of parts (ARCHITECTURE.md, node agent):

* a :class:`~capsa.node.templates.source.SandboxSource` makes session sandboxes: cold boot
  (:class:`~capsa.node.templates.source.ColdBootSource`) or template snapshots with a warm pool
  (:class:`~capsa.node.templates.source.TemplateSource`);
* :class:`~capsa.node.agent.snapshots.Snapshots`, present when the runtime can snapshot, takes, lists and
  restores snapshots of session sandboxes;
* :class:`~capsa.node.agent.sandboxes.SandboxTable` keeps the records and the capacity held by sandboxes being
  made, for every way a sandbox is made;
* :class:`~capsa.node.egress.node_egress.NodeEgress`, when the node has one, gives sandboxes with a policy
  their network.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

from capsa.common.egress_policy import ApprovalScope, EgressPolicy
from capsa.common.errors import CapsaError
from capsa.node.agent.capacity import NodeCapacity, default_capacity
from capsa.node.agent.guest import SandboxGuest
from capsa.node.agent.host_memory import MemoryGuard
from capsa.node.agent.node_metrics import AgentCollector, register_parts
from capsa.node.agent.sandbox_egress import EgressHook
from capsa.node.agent.sandboxes import SandboxRecord, SandboxTable
from capsa.node.agent.shipping import Shipper
from capsa.node.agent.snapshots import Snapshots, check_branch_count, nic_mac_of
from capsa.node.egress.approvals import ApprovalError
from capsa.node.egress.node_egress import EgressRequest, NodeEgress
from capsa.node.egress.trust_store import TrustStore
from capsa.node.net.sandbox_net import SandboxNet
from capsa.node.runtime.base import GuestImage, Runtime, SnapshotCapable, SnapshottingRuntime
from capsa.node.runtime.snapshot.manifest import Snapshot
from capsa.node.storage.floor import SpaceFloor
from capsa.node.templates.source import (
    ColdBootSource,
    MadeSandbox,
    SandboxRequest,
    SandboxSource,
    TemplateSource,
)
from capsa.node.templates.store import BASE, Template
from capsa.node.templates.warm_pool import PoolMetrics

__all__ = ["NodeAgent", "snapshots_for"]

log = logging.getLogger(__name__)

def _with_mac(network: SandboxNet | None, mac: str | None) -> SandboxNet | None:
    """The sandbox's new network with the NIC's MAC from its snapshot (the guest kept that device)."""
    return dataclasses.replace(network, mac=mac) if network is not None and mac is not None else network


def snapshots_for(runtime: Runtime, source: SandboxSource, *, floor: SpaceFloor | None = None,
                  shipper: Shipper | None = None) -> Snapshots | None:
    """The snapshots part for ``runtime`` if it can snapshot, else None; ``floor``: the storage pool's
    free-space floor it keeps; ``shipper``: the fleet's store its snapshots go to."""
    if not isinstance(runtime, SnapshotCapable) or not runtime.can_snapshot:
        return None
    snaps = cast(SnapshottingRuntime, runtime)
    if isinstance(source, TemplateSource):
        return Snapshots(snaps, source.image_for, ram_mode=source.ram_mode, bind=source.bind, floor=floor,
                         shipper=shipper)
    return Snapshots(snaps, source.image_for, floor=floor, shipper=shipper)


class NodeAgent:
    """``source`` makes session sandboxes (default: cold boots of ``image``); ``snapshots`` is the
    snapshots part (default: :func:`snapshots_for` the runtime; pass None explicitly for a node without)."""

    def __init__(self, runtime: Runtime, image: GuestImage, *, node_id: str = "local",
                 capacity: NodeCapacity | None = None, egress: NodeEgress | None = None,
                 source: SandboxSource | None = None,
                 snapshots: Snapshots | Literal["auto"] | None = "auto",
                 trust: TrustStore | None = None) -> None:
        self.runtime = runtime
        self.trust = trust or (source.trust if isinstance(source, TemplateSource) else TrustStore())
        """Where the egress CA goes in a guest (Debian's bundle; tests of host-process guests move it)."""
        self.image = image
        self.egress = egress
        self.node_id = node_id
        self.capacity = capacity or default_capacity()
        self.source: SandboxSource = source if source is not None else ColdBootSource(runtime, {BASE: image})
        self.snapshots: Snapshots | None = (snapshots_for(runtime, self.source) if snapshots == "auto"
                                            else snapshots)
        self.metrics = self.source.metrics if isinstance(self.source, TemplateSource) else PoolMetrics()
        """The node's registry (``GET /metrics``): the warm pool's series, and its parts' (shipping,
        egress decisions, sandboxes running, approvals pending; :mod:`capsa.node.agent.node_metrics`)."""
        reserve = self.capacity.memory_reserve_mib
        self._table = SandboxTable(self.capacity, None if reserve is None else MemoryGuard(
            reserve, pids=lambda: self._table.pids()))
        shipper = self.snapshots.shipper if self.snapshots is not None else None
        register_parts(self.metrics.registry, [
            AgentCollector(lambda: len(self._table.records()), self._approvals_pending),
            *(shipper.metrics.collectors() if shipper is not None else []),
            *(egress.audit.metrics.collectors() if egress is not None else [])])

    def _approvals_pending(self) -> int:
        if self.egress is None:
            return 0
        return len(self.egress.approvals.list())  # the pending ones

    # -- lifecycle of the agent ------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Remove VMs and workdirs a previous agent process left behind (returns what was removed), then
        start the source (template builds and warm pools run in the background)."""
        removed = await self.runtime.cleanup_orphans()
        if self.egress is not None:
            removed += await self.egress.cleanup_stale()
        if removed:
            log.warning("removed %d orphaned sandbox(es): %s", len(removed), removed)
        await self.source.start()
        return removed

    async def wait_ready(self) -> None:
        """Wait until the source's start-up work (the base template build) is over."""
        if isinstance(self.source, TemplateSource):
            await self.source.wait_ready()

    async def close(self) -> None:
        await self.source.close()
        for sandbox_id in self._table.ids():
            await self.destroy(sandbox_id)
        await self.runtime.close()
        if self.egress is not None:
            await self.egress.close()

    # -- capacity ----------------------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        """The declared figures held, and with a memory guard what the host really has: the memory left
        (``memory_available_mib``) and the live sandboxes' PSS (``memory_pss_mib``)."""
        used = self._table.used()
        guard = self._table.guard
        if guard is not None:
            reading = guard.reading()
            used["memory_available_mib"] = reading.available_mib
            used["memory_pss_mib"] = round(reading.pss_mib)
        return used

    def failed_sandboxes(self) -> list[str]:
        return self._table.failed()

    @property
    def store(self) -> str | None:
        """The fleet store this node's snapshots go to (None: they stay here)."""
        shipper = self.snapshots.shipper if self.snapshots is not None else None
        return shipper.store.url if shipper is not None else None

    @property
    def templates(self) -> list[str]:
        """The templates sessions can ask for on this node."""
        return self.source.template_names()

    def info(self) -> dict[str, object]:
        return {"node_id": self.node_id, "runtime": self.runtime.name, "templates": self.templates,
                "capacity": self.capacity.as_dict(), "used": self.used(),
                "failed_sandboxes": self.failed_sandboxes()}

    # -- sandboxes -----------------------------------------------------------------------------------------
    async def create(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                     env: Mapping[str, str], *, policy: EgressPolicy | None = None,
                     secrets: Mapping[str, str] | None = None, session_id: str | None = None,
                     placeholders: Mapping[str, str] | None = None,
                     networks: Sequence[str] = (), tenant: str | None = None) -> SandboxRecord:
        """Make a sandbox from the source. Without ``policy`` it has no NIC at all; with one it gets its own
        namespace behind the egress broker, the broker's CA in its trust store and the placeholders in
        ``env`` (``placeholders``: secret id -> the session's placeholder; missing ones are made up).
        ``networks``: the internal networks the session's tenant was granted; ``tenant``: whose sandbox
        it is (the template's RAM pages are shared only within a tenant)."""
        request = (EgressRequest(policy, secrets or {}, placeholders or {}, session_id, tuple(networks))
                   if policy is not None else None)
        egress = self._egress(request)
        started = time.perf_counter()
        with self._table.reserve([sandbox_id], memory_mib, vcpus):
            if request is None or egress is None:
                made = await self.source.make(SandboxRequest(sandbox_id, template, memory_mib, vcpus,
                                                             tenant=tenant))
                egress_env: dict[str, str] | None = None
            else:
                hook = EgressHook(egress, self.trust, sandbox_id, request)
                try:
                    made = await self.source.make(SandboxRequest(
                        sandbox_id, template, memory_mib, vcpus, attach=hook.attach, prepare=hook.prepare,
                        tenant=tenant))
                except BaseException:
                    await asyncio.shield(egress.detach(sandbox_id))
                    raise
                egress_env = hook.env
        record = SandboxRecord(sandbox_id, template, memory_mib, vcpus,
                               {**made.env, **env, **(egress_env or {})}, made.sandbox,
                               networked=egress_env is not None, egress_env=egress_env or {},
                               nic_mac=made.nic_mac)
        return await self._adopt(record, made, started)

    def _egress(self, request: EgressRequest | None) -> NodeEgress | None:
        if request is not None and self.egress is None:
            raise CapsaError("this node has no egress service: sessions with a policy cannot run here",
                             code="egress_unavailable", status=503)
        return self.egress

    async def _adopt(self, record: SandboxRecord, made: MadeSandbox, started: float) -> SandboxRecord:
        elapsed = time.perf_counter() - started
        record.source, record.snapshot = made.source, made.snapshot
        record.create_ms = round(elapsed * 1000, 3)
        self.metrics.create_seconds.labels(source=made.source).observe(elapsed)
        if not self._table.adopt(record):
            await self.destroy(record.id)
            raise CapsaError(f"sandbox {record.id} was destroyed while it was created",
                             code="sandbox_not_found", status=404)
        return record

    async def update_policy(self, sandbox_id: str, policy: EgressPolicy,
                            secrets: Mapping[str, str] | None = None,
                            placeholders: Mapping[str, str] | None = None,
                            networks: Sequence[str] | None = None) -> bool:
        """Replace a running sandbox's policy; returns whether its CA was re-issued (and re-installed).

        Placeholders of bindings that stay keep their value, new ones take ``placeholders`` (secret id ->
        placeholder) or are made up; the session env changes for new commands."""
        record = self.get(sandbox_id)
        if not record.networked or self.egress is None:
            raise CapsaError(f"sandbox {sandbox_id} was started without a policy and has no network; "
                             "a policy can only be given when the session is created", code="no_network",
                             status=409)
        await self.egress.check_policy(policy)
        update = self.egress.update_policy(sandbox_id, policy, secrets or {}, placeholders, networks)
        if update.ca_reissued:
            await self.trust.install(record.sandbox.guest, update.ca_pem)
        placeholder_env = self.egress.placeholder_env(sandbox_id)
        proxy = {k: v for k, v in record.egress_env.items()
                 if k.lower() in ("http_proxy", "https_proxy", "no_proxy")}
        for key in record.egress_env:
            record.env.pop(key, None)
        record.egress_env = {**proxy, **placeholder_env}
        record.env.update(record.egress_env)
        return update.ca_reissued

    # -- approvals -----------------------------------------------------------------------------------------
    def approvals(self, session_ids: Sequence[str] | None = None, *, include_decided: bool = False
                  ) -> builtins.list[dict[str, Any]]:
        """Requests the egress broker holds for approval (of ``session_ids``; all when None)."""
        if self.egress is None:
            return []
        return [a.as_dict() for a in self.egress.approvals.list(session_ids, include_decided=include_decided)]

    def approval(self, approval_id: str) -> dict[str, Any]:
        if self.egress is None:
            raise ApprovalError(f"approval {approval_id} not found")
        return self.egress.approvals.get(approval_id).as_dict()

    def decide_approval(self, approval_id: str, *, approve: bool, decided_by: str,
                        scope: ApprovalScope | None = None, reason: str | None = None,
                        session_id: str | None = None) -> dict[str, Any]:
        if self.egress is None:
            raise ApprovalError(f"approval {approval_id} not found")
        return self.egress.approvals.decide(approval_id, approve=approve, decided_by=decided_by, scope=scope,
                                            reason=reason, session_id=session_id).as_dict()

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The live sandbox; a dead one raises ``sandbox_failed``, an unknown one ``sandbox_not_found``."""
        return self._table.get(sandbox_id)

    def list(self) -> builtins.list[SandboxRecord]:
        return self._table.records()

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox (idempotent) and its snapshots that are not retained. Returns whether there
        was something to destroy; one still being made is destroyed as soon as it is."""
        if self._table.is_making(sandbox_id):
            self._table.doom(sandbox_id)
            return True
        record = self._table.pop(sandbox_id)
        if record is None:
            return False
        try:
            await asyncio.shield(self.runtime.destroy(record.sandbox))
        finally:
            if record.networked and self.egress is not None:
                await asyncio.shield(self.egress.detach(sandbox_id))
            if self.snapshots is not None:
                await asyncio.to_thread(self.snapshots.drop_unretained, sandbox_id)
        return True

    # -- snapshots -----------------------------------------------------------------------------------------
    def _snapshots(self) -> Snapshots:
        if self.snapshots is None:
            raise CapsaError(f"this node's runtime ({self.runtime.name}) cannot take snapshots",
                             code="snapshots_unavailable", status=501)
        return self.snapshots

    def _snapshottable(self, sandbox_id: str) -> tuple[Snapshots, SandboxRecord]:
        return self._snapshots(), self.get(sandbox_id)

    async def snapshot(self, sandbox_id: str, *, retain: bool = False,
                       labels: Mapping[str, str] | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Snapshot a running sandbox; it keeps running. A sandbox with a NIC is snapshotted with it (its
        MAC is in the manifest's labels): it can only be restored with a policy, onto a new network."""
        snapshots, record = self._snapshottable(sandbox_id)
        return await snapshots.take(sandbox_id, record.sandbox, template=record.template, retain=retain,
                                    labels=labels, nic_mac=record.nic_mac, memory_mib=record.memory_mib,
                                    tenant=tenant)

    async def pause(self, sandbox_id: str, *, labels: Mapping[str, str] | None = None,
                    tenant: str | None = None) -> dict[str, Any]:
        """Snapshot (retained) and destroy the sandbox (and its network)."""
        snapshots, record = self._snapshottable(sandbox_id)
        info = await snapshots.take(sandbox_id, record.sandbox, template=record.template, retain=True,
                                    labels=labels, resume=False, nic_mac=record.nic_mac,
                                    memory_mib=record.memory_mib, tenant=tenant)
        await self.destroy(sandbox_id)
        return info

    @staticmethod
    def _check_network(snap: Snapshot, egress: EgressRequest | None) -> str | None:
        """The MAC of the snapshot's NIC; a snapshot with one needs a policy, one without takes none."""
        mac = nic_mac_of(snap)
        if mac is not None and egress is None:
            raise CapsaError(f"snapshot {snap.id} has a network device: restoring it needs the session's "
                             "egress policy", code="policy_required", status=422)
        if mac is None and egress is not None:
            raise CapsaError(f"snapshot {snap.id} has no network device; a policy can only be given when "
                             "the session is created", code="no_network", status=409)
        return mac

    async def restore(self, snapshot_id: str, sandbox_id: str, env: Mapping[str, str], *,
                      egress: EgressRequest | None = None) -> SandboxRecord:
        """A new sandbox from a snapshot (resume of a paused session, or rollback). A snapshot with a NIC
        gets egress attached again from ``egress`` (the session's policy, secrets and placeholders) on a
        new namespace and tap; the guest's address, route and DNS are set for them on restore and its
        trust store gets the new CA before the sandbox counts as made."""
        snapshots = self._snapshots()
        node_egress = self._egress(egress)
        started = time.perf_counter()
        snap = await snapshots.fetch(snapshot_id)
        mac = self._check_network(snap, egress)
        m = snap.manifest
        with self._table.reserve([sandbox_id], m.memory_mib, m.vcpus):
            hook = None
            if egress is not None and node_egress is not None and mac is not None:
                hook = EgressHook(node_egress, self.trust, sandbox_id, egress)
            try:
                network = await hook.attach(None) if hook is not None else None
                sandbox = await snapshots.restore(snap, sandbox_id, network=_with_mac(network, mac))
                if hook is not None:
                    try:
                        await hook.prepare(sandbox)
                    except BaseException:
                        await asyncio.shield(self.runtime.destroy(sandbox))
                        raise
            except BaseException:
                if hook is not None and node_egress is not None:
                    await asyncio.shield(node_egress.detach(sandbox_id))
                raise
        egress_env = hook.env if hook is not None else {}
        record = SandboxRecord(sandbox_id, snapshots.template_of(snap, BASE), m.memory_mib, m.vcpus,
                               {**env, **egress_env}, sandbox, networked=hook is not None,
                               egress_env=egress_env, nic_mac=mac)
        return await self._adopt(record, MadeSandbox(sandbox, "restore", snap.id, nic_mac=mac), started)

    async def branch(self, snapshot_id: str, sandbox_ids: Sequence[str], env: Mapping[str, str], *,
                     egress: Sequence[EgressRequest] | None = None) -> builtins.list[SandboxRecord]:
        """One new sandbox per id from one snapshot, all or nothing. A snapshot with a NIC needs one
        ``egress`` per id: each branch gets its own namespace, tap, CA and audit identity (its session)."""
        snapshots = self._snapshots()
        started = time.perf_counter()
        check_branch_count(len(sandbox_ids))
        if egress is not None and len(egress) != len(sandbox_ids):
            raise CapsaError("one egress request per branch", code="bad_request", status=400)
        node_egress = self._egress(egress[0] if egress else None)
        snap = await snapshots.fetch(snapshot_id)
        mac = self._check_network(snap, egress[0] if egress else None)
        m = snap.manifest
        with self._table.reserve(list(sandbox_ids), m.memory_mib, m.vcpus):
            hooks: builtins.list[EgressHook] = []
            try:
                if egress is not None and node_egress is not None and mac is not None:
                    for sid, request in zip(sandbox_ids, egress, strict=True):
                        hooks.append(EgressHook(node_egress, self.trust, sid, request))
                        await hooks[-1].attach(None)
                networks = ([_with_mac(h.attached.net if h.attached else None, mac) for h in hooks]
                            if hooks else None)
                made = await snapshots.branch(snap, sandbox_ids, networks=networks)
                if hooks:
                    done = await asyncio.gather(*(h.prepare(sb) for h, sb in zip(hooks, made, strict=True)),
                                                return_exceptions=True)
                    failed = [r for r in done if isinstance(r, BaseException)]
                    if failed:
                        await asyncio.gather(*(asyncio.shield(self.runtime.destroy(sb)) for sb in made),
                                             return_exceptions=True)
                        raise failed[0]
            except BaseException:
                if node_egress is not None:
                    for hook in hooks:
                        await asyncio.shield(node_egress.detach(hook.sandbox_id))
                raise
        template = snapshots.template_of(snap, BASE)
        records = []
        for i, (sid, sandbox) in enumerate(zip(sandbox_ids, made, strict=True)):
            egress_env = hooks[i].env if hooks else {}
            record = SandboxRecord(sid, template, m.memory_mib, m.vcpus, {**env, **egress_env}, sandbox,
                                   networked=bool(hooks), egress_env=egress_env, nic_mac=mac)
            records.append(await self._adopt(record, MadeSandbox(sandbox, "restore", snap.id, nic_mac=mac),
                                             started))
        return records

    def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[dict[str, Any]]:
        return self._snapshots().list(sandbox_id)

    def get_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        return self._snapshots().get(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._snapshots().delete(snapshot_id)

    # -- templates and warm pool ---------------------------------------------------------------------------
    def _templates(self) -> TemplateSource:
        if not isinstance(self.source, TemplateSource):
            raise CapsaError("this node makes sandboxes by cold boot; it has no templates or warm pool",
                             code="snapshots_unavailable", status=501)
        return self.source

    def list_templates(self) -> builtins.list[dict[str, Any]]:
        return self._templates().list_templates()

    def get_template(self, name: str) -> builtins.list[Template]:
        return self._templates().get_template(name)

    async def delete_template(self, name: str) -> None:
        await self._templates().delete_template(name)

    def pool_status(self) -> builtins.list[dict[str, object]]:
        return self._templates().pool_status()

    # -- guest -----------------------------------------------------------------------------------------------
    def guest(self, sandbox_id: str) -> SandboxGuest:
        """The guest of the live sandbox (the node API's guest operations); raises like :meth:`get`."""
        record = self.get(sandbox_id)
        return SandboxGuest(record.id, record.sandbox, record.env)

"""The node agent with templates, a warm pool and snapshots (docs/node-snapshots.md).

:class:`SnapshotNodeAgent` is the :class:`~capsa.node.agent.NodeAgent` for a runtime that can snapshot
(:class:`~capsa.node.runtime.snapshot_runtime.SnapshotRuntime`). Session sandboxes come from template
snapshots: bound from the warm pool, or restored on demand when it is empty. A sandbox of ``base`` with an
egress policy is restored from ``base-net``, the same guest snapshotted with one virtio-net device of a
fixed MAC (:data:`NET_TEMPLATE_MAC`; every sandbox has its own namespace, so equal MACs never meet), built
once with a throwaway tap in a throwaway namespace. The restored NIC gets the new sandbox's tap and the
guest its address; if any of that fails, the sandbox cold-boots through the plain agent instead.

Snapshots of a sandbox carry their origin and retention in their manifest labels, so they survive a node
restart: ``capsa.sandbox`` (the agent's sandbox id) and ``capsa.retain`` ("1" or "0"). Destroying a
sandbox deletes its snapshots that are not retained; pause snapshots are always retained.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.common.ids import is_id, new_id
from capsa.node.agent import NodeAgent, NodeCapacity, SandboxRecord
from capsa.node.pool import PoolKey, PoolMetrics, WarmPool, bind_identity
from capsa.node.runtime.base import GuestImage, Sandbox, VMSpec
from capsa.node.runtime.snapshot import RamMode, check_branch_count
from capsa.node.runtime.snapshot_manifest import SnapshotError
from capsa.node.runtime.snapshot_runtime import Snapshot, SnapshotRuntime, SnapshotSandbox
from capsa.node.template_build import remove_stale_work
from capsa.node.templates import BASE, Template, TemplateStore, check_template_name

__all__ = ["NET_TEMPLATE", "NET_TEMPLATE_MAC", "SnapshotNodeAgent", "SnapshotRecord", "snapshot_info"]

log = logging.getLogger(__name__)

LABEL_SANDBOX = "capsa.sandbox"
LABEL_RETAIN = "capsa.retain"
LABEL_TEMPLATE = "capsa.template_name"
_USER_LABEL_MAX = 32
NET_TEMPLATE = "base-net"
NET_TEMPLATE_MAC = "02:ca:00:00:00:01"


@dataclass
class SnapshotRecord(SandboxRecord):
    source: str = "boot"
    """pool | restore | boot"""
    snapshot: str | None = None
    create_ms: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {**super().as_dict(), "source": self.source, "snapshot": self.snapshot,
                "create_ms": self.create_ms}


def snapshot_info(snap: Snapshot) -> dict[str, Any]:
    m = snap.manifest
    labels = dict(m.labels)
    size = sum(p.stat().st_size for p in snap.path.iterdir() if p.is_file())
    return {"id": m.id, "sandbox_id": labels.get(LABEL_SANDBOX), "retain": labels.get(LABEL_RETAIN) == "1",
            "template": labels.get(LABEL_TEMPLATE), "created_at": m.created_at.isoformat(),
            "parent": m.parent, "memory_mib": m.memory_mib, "vcpus": m.vcpus, "image_digest": m.image_digest,
            "size_bytes": size,
            "labels": {k: v for k, v in labels.items() if not k.startswith("capsa.")}}


def _hostname(sandbox_id: str) -> str:
    # Hostnames may not contain '_'.
    return sandbox_id.replace("_", "-")


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    labels = dict(labels or {})
    if len(labels) > _USER_LABEL_MAX or any(k.startswith("capsa.") for k in labels):
        raise CapsaError(f"at most {_USER_LABEL_MAX} labels, none starting with 'capsa.'", code="bad_request",
                         status=400)
    return labels


class SnapshotNodeAgent(NodeAgent):
    def __init__(self, runtime: SnapshotRuntime, image: GuestImage, *, node_id: str = "local",
                 capacity: NodeCapacity | None = None, pool_size: int = 1,
                 pool_sizes: Mapping[str, int] | None = None, ram_mode: RamMode = RamMode.COPY,
                 base_memory_mib: int = 256, base_vcpus: int = 1, **kwargs: Any) -> None:
        super().__init__(runtime, image, node_id=node_id, capacity=capacity, **kwargs)  # type: ignore[arg-type]
        self.snap_runtime = runtime
        self.image = image
        self.ram_mode = ram_mode
        self.template_store = TemplateStore(runtime, image, base_memory_mib=base_memory_mib,
                                            base_vcpus=base_vcpus)
        self.metrics = PoolMetrics()
        self.warm = WarmPool(self._pool_restore, self._pool_destroy, default_size=pool_size,
                             sizes=pool_sizes, metrics=self.metrics)
        self._warmup: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> list[str]:
        removed = await super().start()
        self._warmup = asyncio.create_task(self._warm_up(), name="templates-warm-up")
        return removed

    async def _warm_up(self) -> None:
        """Build ``base`` if missing and start filling the pools of the templates on disk."""
        try:
            await asyncio.to_thread(remove_stale_work, self.template_store.root)
            base = await self.template_store.ensure_base(self.template_store.base_memory_mib,
                                                         self.template_store.base_vcpus)
            self.warm.watch(base.key)
            for t in await asyncio.to_thread(self.template_store.all):
                if t.name != BASE and await asyncio.to_thread(self.template_store.is_current, t):
                    self.warm.watch(t.key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("building the base template failed; sandboxes will build it on demand")

    async def wait_ready(self) -> None:
        """Wait until the start-up template build is over (tests and benchmarks)."""
        if self._warmup is not None:
            await asyncio.shield(self._warmup)

    async def close(self) -> None:
        if self._warmup is not None:
            self._warmup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warmup
        await self.warm.close()
        await super().close()

    def info(self) -> dict[str, object]:
        out = super().info()
        out["templates"] = sorted((set(self.template_store.names()) | set(self.templates)) - {NET_TEMPLATE})
        return out

    # -- making sandboxes ----------------------------------------------------------------------------------

    def _image_for(self, digest: str) -> GuestImage:
        for image in (self.image, *self.templates.values()):
            if image.digest == digest:
                return image
        raise CapsaError(f"no guest image {digest} on this node for that snapshot", code="snapshot_mismatch",
                         status=409)

    async def _restore(self, snap: Snapshot, sandbox_id: str | None, labels: Mapping[str, str],
                       ram_mode: RamMode | None = None) -> SnapshotSandbox:
        m = snap.manifest
        spec = VMSpec(image=self._image_for(m.image_digest), memory_mib=m.memory_mib, vcpus=m.vcpus,
                      labels=dict(labels))
        return await self.snap_runtime.restore(snap, spec, sandbox_id=sandbox_id,
                                               ram_mode=ram_mode or self.ram_mode)

    async def _pool_restore(self, key: PoolKey) -> Sandbox:
        template = await self.template_store.resolve(*key)
        sandbox = await self._restore(template.snapshot, None, {"template": key[0], "pooled": "1"})
        try:
            # A restored guest starts with cold caches (under TCG: no translated code; its RAM pages are
            # faulted in from the snapshot on first touch), so its first command is slow. Spend that on
            # a throwaway command while it waits in the pool, not on the user's first one.
            await sandbox.guest.exec(["sh", "-c", "true"], timeout=60)
        except BaseException:
            await asyncio.shield(self.snap_runtime.destroy(sandbox))
            raise
        return sandbox

    async def _pool_destroy(self, sandbox: Sandbox) -> None:
        await self.snap_runtime.destroy(sandbox)

    def _reserve(self, ids: list[str], memory_mib: int, vcpus: int) -> None:
        """Validate new sandbox ids and hold capacity for them (released by the caller)."""
        for sid in ids:
            if not is_id(sid, "sbx"):
                raise CapsaError(f"bad sandbox id {sid!r}", code="bad_request", status=400)
            if sid in self._sandboxes or sid in self._booting:
                raise CapsaError(f"sandbox {sid} exists", code="already_exists", status=409)
        if len(set(ids)) != len(ids):
            raise CapsaError("sandbox ids must be distinct", code="bad_request", status=400)
        used = self.used()
        n = len(ids)
        if (used["sandboxes"] + n > self.capacity.max_sandboxes
                or used["memory_mib"] + n * memory_mib > self.capacity.memory_mib
                or used["vcpus"] + n * vcpus > self.capacity.vcpus):
            raise CapsaError("node is full", code="no_capacity", status=503)
        for sid in ids:
            self._booting[sid] = (memory_mib, vcpus)

    async def _adopt(self, sandbox_id: str, sandbox: SnapshotSandbox, *, template: str,
                     env: Mapping[str, str], source: str, snapshot: str, started: float,
                     egress_env: Mapping[str, str] | None = None) -> SnapshotRecord:
        m = sandbox.files.spec
        record = SnapshotRecord(sandbox_id, template, m.memory_mib, m.vcpus, dict(env), sandbox,
                                networked=egress_env is not None, egress_env=dict(egress_env or {}),
                                source=source, snapshot=snapshot,
                                create_ms=round((time.perf_counter() - started) * 1000, 3))
        self._sandboxes[sandbox_id] = record
        self.metrics.create_seconds.labels(source=source).observe(time.perf_counter() - started)
        if sandbox_id in self._doomed:
            await self.destroy(sandbox_id)
            raise CapsaError(f"sandbox {sandbox_id} was destroyed while it was created",
                             code="sandbox_not_found", status=404)

        def _died(reason: str) -> None:
            log.warning("sandbox %s died: %s", sandbox_id, reason)
            if sandbox_id in self._sandboxes:
                self._failed.add(sandbox_id)

        sandbox.on_failure(_died)
        return record

    async def _bind(self, sandbox: Sandbox, hostname: str) -> None:
        try:
            await bind_identity(sandbox.guest, hostname=hostname)
        except BaseException:
            await asyncio.shield(self.snap_runtime.destroy(sandbox))
            raise

    async def create(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                     env: Mapping[str, str], **kwargs: Any) -> SandboxRecord:
        """A session sandbox from template ``template``: from the warm pool, else restored on demand."""
        if template == NET_TEMPLATE:
            # Its NIC needs a tap: it only serves sessions of ``base`` with a policy.
            raise CapsaError(f"template {template!r} is internal to the node", code="template_not_found",
                             status=404)
        policy = kwargs.get("policy")
        if policy is not None:
            if template == BASE and self.egress is not None:
                try:
                    return await self._create_networked(sandbox_id, memory_mib, vcpus, env, policy,
                                                        kwargs.get("secrets"), kwargs.get("session_id"))
                except CapsaError as exc:
                    # The request's own faults (bad ids or secrets, a full node) would fail a cold boot too.
                    if exc.status in (400, 404, 422, 503) or exc.code == "already_exists":
                        raise
                    log.warning("restoring %s from %s failed, cold-booting it: %s", sandbox_id,
                                NET_TEMPLATE, exc)
                except Exception as exc:
                    log.warning("restoring %s from %s failed, cold-booting it: %s", sandbox_id,
                                NET_TEMPLATE, exc)
            return await super().create(sandbox_id, template, memory_mib, vcpus, env, **kwargs)
        started = time.perf_counter()
        self._reserve([sandbox_id], memory_mib, vcpus)
        tpl: Template | None = None
        try:
            tpl = await self.template_store.resolve(template, memory_mib, vcpus)
            sandbox = self.warm.take(tpl.key)
            source = "pool"
            if sandbox is None:
                source = "restore"
                sandbox = await self._restore(tpl.snapshot, None,
                                              {"sandbox": sandbox_id, "template": template})
            assert isinstance(sandbox, SnapshotSandbox)
            await self._bind(sandbox, _hostname(sandbox_id))
        finally:
            del self._booting[sandbox_id]
            if tpl is not None:
                self.warm.watch(tpl.key)
        # The template's own env (from its spec) under the request's.
        template_env = (tpl.spec or {}).get("env") or {}
        return await self._adopt(sandbox_id, sandbox, template=template, env={**template_env, **env},
                                 source=source, snapshot=tpl.snapshot.id, started=started)

    async def _net_template(self, memory_mib: int, vcpus: int) -> Template:
        """``base`` with a NIC (MAC :data:`NET_TEMPLATE_MAC`), cold-booted and snapshotted on first use."""
        assert self.egress is not None
        store = self.template_store
        async with store._lock((NET_TEMPLATE, memory_mib, vcpus)):
            found = await asyncio.to_thread(store.find, NET_TEMPLATE, memory_mib, vcpus)
            if found is not None and await asyncio.to_thread(store.is_current, found, NET_TEMPLATE_MAC):
                return found
            log.info("building template %s (%d MiB, %d vCPU)", NET_TEMPLATE, memory_mib, vcpus)
            # A throwaway namespace and tap (with the sandbox firewall: nothing leaves it) just for the build.
            manager = self.egress.service.manager
            net = await manager.create(new_id("sbx"))
            try:
                spec = VMSpec(image=self.image, memory_mib=memory_mib, vcpus=vcpus,
                              network=dataclasses.replace(net, mac=NET_TEMPLATE_MAC),
                              labels={"template": NET_TEMPLATE})
                sandbox = await self.snap_runtime.boot(spec)
                assert isinstance(sandbox, SnapshotSandbox)
                return await store.store(NET_TEMPLATE, sandbox, spec=None)
            finally:
                await asyncio.shield(manager.destroy(net))

    async def _create_networked(self, sandbox_id: str, memory_mib: int, vcpus: int, env: Mapping[str, str],
                                policy: EgressPolicy, secrets: Mapping[str, str] | None,
                                session_id: str | None) -> SnapshotRecord:
        """A sandbox with egress restored from the networked template: attach egress (namespace, tap,
        rules, broker, CA), restore with the new tap, set the guest's address, install the CA."""
        assert self.egress is not None
        started = time.perf_counter()
        self._reserve([sandbox_id], memory_mib, vcpus)
        attached = None
        try:
            tpl = await self._net_template(memory_mib, vcpus)
            attached = await self.egress.attach(sandbox_id, policy, secrets or {}, session_id=session_id)
            spec = VMSpec(image=self._image_for(tpl.snapshot.manifest.image_digest), memory_mib=memory_mib,
                          vcpus=vcpus, network=dataclasses.replace(attached.net, mac=NET_TEMPLATE_MAC),
                          labels={"sandbox": sandbox_id, "template": BASE})
            sandbox = await self.snap_runtime.restore(tpl.snapshot, spec, sandbox_id=sandbox_id,
                                                      ram_mode=RamMode.COPY)
            try:
                await bind_identity(sandbox.guest, hostname=_hostname(sandbox_id))
                await self._install_ca(sandbox, attached.ca_pem)
            except BaseException:
                await asyncio.shield(self.snap_runtime.destroy(sandbox))
                raise
        except BaseException:
            if attached is not None:
                await asyncio.shield(self.egress.detach(sandbox_id))
            raise
        finally:
            del self._booting[sandbox_id]
        egress_env = dict(attached.env)
        return await self._adopt(sandbox_id, sandbox, template=BASE, env={**env, **egress_env},
                                 source="restore", snapshot=tpl.snapshot.id, started=started,
                                 egress_env=egress_env)

    # -- snapshots -----------------------------------------------------------------------------------------

    def _snapshot_sandbox(self, sandbox_id: str) -> tuple[SandboxRecord, SnapshotSandbox]:
        record = self.get(sandbox_id)
        if record.networked or not isinstance(record.sandbox, SnapshotSandbox):
            raise CapsaError(f"sandbox {sandbox_id} cannot be snapshotted (it was booted with a network "
                             "device, which templates and snapshots do not carry yet)",
                             code="snapshot_unsupported", status=409)
        return record, record.sandbox

    async def snapshot(self, sandbox_id: str, *, retain: bool = False,
                       labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Snapshot a running sandbox; it keeps running."""
        record, sandbox = self._snapshot_sandbox(sandbox_id)
        all_labels = {**_check_labels(labels), LABEL_SANDBOX: sandbox_id,
                      LABEL_RETAIN: "1" if retain else "0", LABEL_TEMPLATE: record.template}
        snap = await self.snap_runtime.snapshot(sandbox, new_id("snap"), labels=all_labels)
        return snapshot_info(snap)

    async def pause(self, sandbox_id: str, *, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Snapshot (retained) and destroy the sandbox."""
        record, sandbox = self._snapshot_sandbox(sandbox_id)
        all_labels = {**_check_labels(labels), LABEL_SANDBOX: sandbox_id, LABEL_RETAIN: "1",
                      LABEL_TEMPLATE: record.template}
        snap = await self.snap_runtime.snapshot(sandbox, new_id("snap"), resume=False, labels=all_labels)
        await self.destroy(sandbox_id)
        return snapshot_info(snap)

    def open_snapshot(self, snapshot_id: str) -> Snapshot:
        if not is_id(snapshot_id, "snap"):
            raise CapsaError(f"snapshot {snapshot_id!r} not found", code="snapshot_not_found", status=404)
        path = self.snap_runtime.pool.snapshot_dir(snapshot_id)
        if not path.is_dir():
            raise CapsaError(f"snapshot {snapshot_id} not found", code="snapshot_not_found", status=404)
        return Snapshot.open(path)

    def get_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        return snapshot_info(self.open_snapshot(snapshot_id))

    def list_snapshots(self, sandbox_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for sid in self.snap_runtime.pool.list_snapshots():
            if not is_id(sid, "snap"):
                continue
            try:
                info = snapshot_info(Snapshot.open(self.snap_runtime.pool.snapshot_dir(sid)))
            except (SnapshotError, OSError) as exc:
                log.warning("unreadable snapshot %s: %s", sid, exc)
                continue
            if sandbox_id is None or info["sandbox_id"] == sandbox_id:
                out.append(info)
        return sorted(out, key=lambda i: (i["created_at"], i["id"]))

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.open_snapshot(snapshot_id)
        self.snap_runtime.delete_snapshot(snapshot_id)

    async def restore(self, snapshot_id: str, sandbox_id: str, env: Mapping[str, str]) -> SnapshotRecord:
        """A new sandbox from a snapshot (resume of a paused session, or rollback)."""
        started = time.perf_counter()
        snap = await asyncio.to_thread(self.open_snapshot, snapshot_id)
        m = snap.manifest
        self._reserve([sandbox_id], m.memory_mib, m.vcpus)
        try:
            sandbox = await self._restore(snap, sandbox_id, {"sandbox": sandbox_id})
            await self._bind(sandbox, _hostname(sandbox_id))
        finally:
            del self._booting[sandbox_id]
        return await self._adopt(sandbox_id, sandbox, template=m.labels.get(LABEL_TEMPLATE, BASE), env=env,
                                 source="restore", snapshot=snap.id, started=started)

    async def branch(self, snapshot_id: str, sandbox_ids: list[str],
                     env: Mapping[str, str]) -> list[SnapshotRecord]:
        """One new sandbox per id from one snapshot, all or nothing."""
        started = time.perf_counter()
        check_branch_count(len(sandbox_ids))
        snap = await asyncio.to_thread(self.open_snapshot, snapshot_id)
        m = snap.manifest
        self._reserve(list(sandbox_ids), m.memory_mib, m.vcpus)
        try:
            results = await asyncio.gather(
                *(self._restore(snap, sid, {"sandbox": sid}, RamMode.PRIVATE) for sid in sandbox_ids),
                return_exceptions=True)
            made = [r for r in results if isinstance(r, SnapshotSandbox)]
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                bound = await asyncio.gather(*(bind_identity(sb.guest, hostname=_hostname(sid))
                                               for sid, sb in zip(sandbox_ids, made, strict=True)),
                                             return_exceptions=True)
                errors = [r for r in bound if isinstance(r, BaseException)]
            if errors:
                await asyncio.gather(*(self.snap_runtime.destroy(sb) for sb in made), return_exceptions=True)
                raise errors[0]
        finally:
            for sid in sandbox_ids:
                self._booting.pop(sid, None)
        template = m.labels.get(LABEL_TEMPLATE, BASE)
        records = []
        for sid, sb in zip(sandbox_ids, made, strict=True):
            records.append(await self._adopt(sid, sb, template=template, env=env, source="restore",
                                             snapshot=snap.id, started=started))
        return records

    async def destroy(self, sandbox_id: str) -> bool:
        existed = await super().destroy(sandbox_id)
        if existed and sandbox_id not in self._booting:
            await asyncio.to_thread(self._drop_snapshots_of, sandbox_id)
        return existed

    def _drop_snapshots_of(self, sandbox_id: str) -> None:
        for info in self.list_snapshots(sandbox_id):
            if not info["retain"]:
                self.snap_runtime.delete_snapshot(str(info["id"]))

    # -- templates and pool --------------------------------------------------------------------------------

    def list_templates(self) -> list[dict[str, Any]]:
        return [t.as_dict() for t in self.template_store.all()]

    def get_template(self, name: str) -> list[Template]:
        variants = self.template_store.variants(name)
        if not variants:
            raise CapsaError(f"template {name!r} not on this node", code="template_not_found", status=404)
        return variants

    async def delete_template(self, name: str) -> None:
        check_template_name(name)
        if name == BASE:
            raise CapsaError("the base template cannot be deleted (it is rebuilt on demand)",
                             code="template_protected", status=409)
        self.get_template(name)
        await self.warm.drain(name)
        await asyncio.to_thread(self.template_store.delete, name)

    def pool_status(self) -> list[dict[str, object]]:
        return self.warm.status()

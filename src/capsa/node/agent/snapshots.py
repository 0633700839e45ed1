"""The node's snapshots of session sandboxes (docs/node-snapshots.md): take, pause, restore, branch, list.

:class:`Snapshots` is the node agent's part for a runtime that can snapshot
(:class:`~capsa.node.runtime.base.SnapshottingRuntime`: a :class:`~capsa.node.runtime.base.Runtime` that is
also :class:`~capsa.node.runtime.base.SnapshotCapable`). It talks to the runtime and labels what it takes;
the agent keeps the sandbox records and the capacity.

Snapshots of a sandbox carry their origin and retention in their manifest labels, so they survive a node
restart: ``capsa.sandbox`` (the agent's sandbox id), ``capsa.retain`` ("1" or "0"),
``capsa.template_name`` and, for a sandbox with a NIC, ``capsa.nic_mac``. Destroying a sandbox deletes its
snapshots that are not retained (:meth:`Snapshots.drop_unretained`); pause snapshots are always retained.

With a :class:`~capsa.node.storage.floor.SpaceFloor`, taking a snapshot (also for a pause), restoring and
branching are refused with ``storage_full`` (507) when they could leave the storage pool with less free
space than the floor: each may write up to its RAM size (a snapshot's memory file; a restored sandbox's
RAM file, a reflink that diverges as the guest writes) per sandbox.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from capsa.common.errors import CapsaError
from capsa.common.ids import is_id, new_id
from capsa.common.image import GuestImage
from capsa.node.agent.shipping import LABEL_TENANT, Shipper
from capsa.node.guestlink.identity import IdentityBinder, bind_sandbox, hostname_for
from capsa.node.runtime.base import LABEL_PRIVATE_RAM, RamMode, Sandbox, SnapshottingRuntime, VMSpec
from capsa.node.runtime.snapshot.manifest import Snapshot
from capsa.node.storage.floor import MiB, SpaceFloor

__all__ = [
    "LABEL_NIC",
    "LABEL_RETAIN",
    "LABEL_SANDBOX",
    "LABEL_TEMPLATE",
    "MAX_BRANCHES",
    "Snapshots",
    "check_branch_count",
    "nic_mac_of",
    "snapshot_info",
]

log = logging.getLogger(__name__)

LABEL_SANDBOX = "capsa.sandbox"
LABEL_RETAIN = "capsa.retain"
LABEL_TEMPLATE = "capsa.template_name"
LABEL_NIC = "capsa.nic_mac"
"""The MAC of the sandbox's NIC when it had one (a sandbox with an egress policy): restoring the snapshot
needs a network, given that MAC (the guest kept the device)."""
MAX_BRANCHES = 64
STORED_MARK = ".stored"
"""An empty file in a snapshot's directory once the snapshot is in the fleet's store."""
_USER_LABEL_MAX = 32


def snapshot_info(snap: Snapshot) -> dict[str, Any]:
    m = snap.manifest
    labels = dict(m.labels)
    size = sum(p.stat().st_size for p in snap.path.iterdir() if p.is_file() and p.name != STORED_MARK)
    return {"id": m.id, "sandbox_id": labels.get(LABEL_SANDBOX), "retain": labels.get(LABEL_RETAIN) == "1",
            "template": labels.get(LABEL_TEMPLATE), "created_at": m.created_at.isoformat(),
            "parent": m.parent, "memory_mib": m.memory_mib, "vcpus": m.vcpus, "image_digest": m.image_digest,
            "size_bytes": size, "stored": (snap.path / STORED_MARK).exists(),
            "labels": {k: v for k, v in labels.items() if not k.startswith("capsa.")}}


def nic_mac_of(snap: Snapshot) -> str | None:
    """The MAC of the snapshot's NIC, None when the sandbox had none."""
    return snap.manifest.labels.get(LABEL_NIC) or None


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    labels = dict(labels or {})
    if len(labels) > _USER_LABEL_MAX or any(k.startswith("capsa.") for k in labels):
        raise CapsaError(f"at most {_USER_LABEL_MAX} labels, none starting with 'capsa.'", code="bad_request",
                         status=400)
    return labels


def check_branch_count(n: int) -> None:
    if not 1 <= n <= MAX_BRANCHES:
        raise CapsaError(f"branch count must be between 1 and {MAX_BRANCHES}, got {n}",
                         code="invalid_branch_count", status=422)


@dataclass(eq=False)
class Snapshots:
    """Snapshots of session sandboxes on ``runtime``; ``image_for`` finds the guest image of a digest."""

    runtime: SnapshottingRuntime
    image_for: Callable[[str], GuestImage]
    _: KW_ONLY
    ram_mode: RamMode = RamMode.COPY
    bind: IdentityBinder[Sandbox] = bind_sandbox
    floor: SpaceFloor | None = None
    """The storage pool's free-space floor (None: none is kept)."""
    shipper: Shipper | None = None
    """The fleet's store (None: snapshots stay on this node)."""

    async def _check_space(self, memory_mib: int, what: str) -> None:
        if self.floor is not None:  # in a thread: reading the pool's free space waits for its writeback
            await asyncio.to_thread(self.floor.check, memory_mib * MiB, what)

    async def take(self, sandbox_id: str, sandbox: Sandbox, *, template: str, retain: bool,
                   labels: Mapping[str, str] | None, resume: bool = True,
                   nic_mac: str | None = None, memory_mib: int = 0, tenant: str | None = None
                   ) -> dict[str, Any]:
        """Snapshot a running sandbox; ``resume=False`` leaves it stopped (pause: the caller destroys it).
        ``nic_mac``: the sandbox's NIC (recorded, so a restore gives the device a network again);
        ``memory_mib``: its RAM (what the snapshot may write, checked against the floor); ``tenant``: whose
        it is (its chunks' scope in the store). A retained snapshot is pushed to the store, when there is
        one, before this returns; a store that fails leaves it here only (``stored`` false, logged)."""
        await self._check_space(memory_mib, f"a snapshot of {sandbox_id}")
        all_labels = {**_check_labels(labels), LABEL_SANDBOX: sandbox_id,
                      LABEL_RETAIN: "1" if retain else "0", LABEL_TEMPLATE: template}
        if nic_mac is not None:
            all_labels[LABEL_NIC] = nic_mac
        if tenant is not None:
            all_labels[LABEL_TENANT] = tenant
        snap = await self.runtime.snapshot(sandbox, new_id("snap"), resume=resume, labels=all_labels)
        if retain and self.shipper is not None:
            try:
                await self.shipper.push(snap)
            except CapsaError as e:
                log.warning("%s", e)
            else:
                (snap.path / STORED_MARK).touch()
        return snapshot_info(snap)

    def open(self, snapshot_id: str) -> Snapshot:
        return self.runtime.open_snapshot(snapshot_id)

    async def fetch(self, snapshot_id: str) -> Snapshot:
        """The snapshot, pulled from the fleet's store first when this node does not hold it."""
        if self.shipper is not None and is_id(snapshot_id, "snap"):
            await self.shipper.pull(snapshot_id)
        return await asyncio.to_thread(self.open, snapshot_id)

    def get(self, snapshot_id: str) -> dict[str, Any]:
        return snapshot_info(self.open(snapshot_id))

    def list(self, sandbox_id: str | None = None) -> builtins.list[dict[str, Any]]:
        out = []
        for sid in self.runtime.list_snapshot_ids():
            try:
                info = snapshot_info(self.runtime.open_snapshot(sid))
            except (CapsaError, OSError) as exc:
                log.warning("unreadable snapshot %s: %s", sid, exc)
                continue
            if sandbox_id is None or info["sandbox_id"] == sandbox_id:
                out.append(info)
        return sorted(out, key=lambda i: (i["created_at"], i["id"]))

    async def delete(self, snapshot_id: str) -> None:
        """Delete the snapshot here and from the store; ``snapshot_not_found`` when neither holds it."""
        try:
            snap = await asyncio.to_thread(self.open, snapshot_id)
        except CapsaError as e:
            if self.shipper is None or e.code != "snapshot_not_found":
                raise
            if not await self.shipper.holds(snapshot_id):
                raise
        else:
            await asyncio.to_thread(self.runtime.delete_snapshot, snap)
        if self.shipper is not None:
            await self.shipper.forget(snapshot_id)

    def drop_unretained(self, sandbox_id: str) -> None:
        """Delete the snapshots of ``sandbox_id`` that were not taken to be kept."""
        for info in self.list(sandbox_id):
            if not info["retain"]:
                self.runtime.delete_snapshot(str(info["id"]))

    @staticmethod
    def template_of(snap: Snapshot, default: str) -> str:
        return snap.manifest.labels.get(LABEL_TEMPLATE, default)

    def spec_for(self, snap: Snapshot, labels: Mapping[str, str], network: object | None = None) -> VMSpec:
        m = snap.manifest
        return VMSpec(image=self.image_for(m.image_digest), memory_mib=m.memory_mib, vcpus=m.vcpus,
                      network=network, labels=dict(labels))

    async def restore(self, snap: Snapshot, sandbox_id: str, *, ram_mode: RamMode | None = None,
                      network: object | None = None) -> Sandbox:
        """A new sandbox from ``snap``, bound to its identity (hostname from ``sandbox_id``); ``network``:
        the NIC's new tap (the runtime sets the guest's address for it). A snapshot of a sandbox with
        private RAM (a ``ram: private`` template's) is restored with private RAM again."""
        await self._check_space(snap.manifest.memory_mib, f"a sandbox restored from {snap.id}")
        if ram_mode is None:
            private = snap.manifest.labels.get(LABEL_PRIVATE_RAM) == "private"
            ram_mode = RamMode.CLONE if private else self.ram_mode
        sandbox = await self.runtime.restore(snap, self.spec_for(snap, {"sandbox": sandbox_id}, network),
                                             sandbox_id=sandbox_id, ram_mode=ram_mode)
        try:
            await self.bind(sandbox, hostname_for(sandbox_id))
        except BaseException:
            await asyncio.shield(self.runtime.destroy(sandbox))
            raise
        return sandbox

    async def branch(self, snap: Snapshot, sandbox_ids: Sequence[str], *,
                     networks: Sequence[object | None] | None = None) -> builtins.list[Sandbox]:
        """One new sandbox per id from ``snap``, restored concurrently with private RAM. All or nothing.
        ``networks``: one per id, for a snapshot with a NIC."""
        check_branch_count(len(sandbox_ids))
        await self._check_space(len(sandbox_ids) * snap.manifest.memory_mib,
                                f"{len(sandbox_ids)} sandboxes branched from {snap.id}")
        nets = list(networks) if networks is not None else [None] * len(sandbox_ids)
        results = await asyncio.gather(
            *(self.runtime.restore(snap, self.spec_for(snap, {"sandbox": sid}, net), sandbox_id=sid,
                                   ram_mode=RamMode.PRIVATE)
              for sid, net in zip(sandbox_ids, nets, strict=True)),
            return_exceptions=True)
        made = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            bound = await asyncio.gather(*(self.bind(sb, hostname_for(sid))
                                           for sid, sb in zip(sandbox_ids, made, strict=True)),
                                         return_exceptions=True)
            errors = [r for r in bound if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(self.runtime.destroy(sb) for sb in made), return_exceptions=True)
            raise errors[0]
        return made


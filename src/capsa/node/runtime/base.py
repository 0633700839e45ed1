"""The runtime protocol: what every VM driver (QEMU microvm now, Firecracker later) provides.

The node agent only ever talks to a driver through these types; it never builds a QEMU command
line or speaks QMP itself. A driver returns :class:`Sandbox` handles; the guest is reached through
``sandbox.guest`` (a :class:`capsa.node.guestlink.client.GuestClient`). A driver that can also snapshot is a
:class:`SnapshottingRuntime` (:class:`Runtime` and :class:`SnapshotCapable`).
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from capsa.common.errors import CapsaError
from capsa.common.image import GuestImage

if TYPE_CHECKING:
    from capsa.node.guestlink.client import GuestClient
    from capsa.node.runtime.snapshot.manifest import Snapshot

__all__ = [
    "LABEL_PRIVATE_RAM",
    "TAP_NETWORK_FIELDS",
    "Accelerator",
    "BootError",
    "FailureCallback",
    "GuestImage",
    "RamMode",
    "Runtime",
    "RuntimeError_",
    "Sandbox",
    "SandboxFailed",
    "SandboxState",
    "SnapshotCapable",
    "SnapshottingRuntime",
    "TapNetwork",
    "VMSpec",
]


class Accelerator(enum.StrEnum):
    AUTO = "auto"
    KVM = "kvm"
    TCG = "tcg"


class SandboxState(enum.StrEnum):
    BOOTING = "booting"
    RUNNING = "running"
    FAILED = "failed"  # the VM died or stopped answering; resources still need destroy()
    DESTROYED = "destroyed"


class RamMode(enum.StrEnum):
    """How a restored VM gets its RAM from a snapshot."""

    PRIVATE = "private"
    """Map the snapshot's frozen memory.ram privately: nothing copied, clones share clean pages."""
    COPY = "copy"
    """Reflink memory.ram into the sandbox and map it shared: the restored VM snapshots cheaply again."""
    CLONE = "clone"
    """Reflink memory.ram into the sandbox and map that copy privately: what the guest writes stays in
    anonymous memory. A shared mapping's dirty pages are written back to the pool while the VM runs (a
    browser guest rewrote its 1 GiB about 12 times in 6 minutes, and its vCPU waited on those writes);
    a private one writes nothing, and a snapshot then writes the whole RAM instead of a reflink."""


LABEL_PRIVATE_RAM = "capsa.ram"
"""Snapshot label (value ``private``) a runtime sets on a snapshot of a sandbox running in
:attr:`RamMode.CLONE`, so that restoring it keeps the RAM private (``capsa.node.agent.snapshots``)."""


class RuntimeError_(CapsaError):
    code = "runtime_error"
    status = 500


class BootError(RuntimeError_):
    code = "boot_failed"
    status = 500


class SandboxFailed(RuntimeError_):
    """The sandbox's VM is gone (killed, crashed) or its guest stopped answering."""

    code = "sandbox_failed"
    status = 409


FailureCallback = Callable[[str], Awaitable[None] | None]


class TapNetwork(Protocol):
    """What a driver needs from ``VMSpec.network`` (:class:`capsa.node.net.SandboxNet` provides it):
    a tap inside a network namespace, and the guest's side of its subnet."""

    @property
    def netns(self) -> str: ...
    @property
    def tap(self) -> str: ...
    @property
    def mac(self) -> str: ...
    @property
    def guest_ip(self) -> str: ...
    @property
    def gateway_ip(self) -> str: ...
    @property
    def prefixlen(self) -> int: ...


TAP_NETWORK_FIELDS = ("netns", "tap", "mac", "guest_ip", "gateway_ip", "prefixlen")


@dataclass(frozen=True)
class VMSpec:
    image: GuestImage
    memory_mib: int = 256
    vcpus: int = 1
    disk_size_mib: int | None = None  # grow the private disk copy to this size; None keeps the image size
    rootfs: Path | None = None
    """A cold boot's disk is a copy of this root filesystem instead of the image's (a template build's copy
    with packages installed on the host); the kernel and initramfs stay the image's."""
    private_ram: bool = False
    """A cold boot's RAM is mapped privately (anonymous pages, nothing written back to the storage pool
    while the VM runs; its snapshots carry the RAM in their stream): a build VM's, whose guest rewrites
    much of its memory."""
    network: object | None = None  # filled in by the egress work (capsa.node.net); None = no NIC at all
    kernel_args: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    background: bool = False
    """Run at the lowest CPU priority until :meth:`Sandbox.set_background` (False) says otherwise: a warm
    pool's restores and warm-ups must not take CPU from sandboxes that serve users."""


@runtime_checkable
class Sandbox(Protocol):
    """One running VM."""

    @property
    def id(self) -> str: ...

    @property
    def state(self) -> SandboxState: ...

    @property
    def accelerator(self) -> Accelerator: ...

    @property
    def guest(self) -> GuestClient: ...

    @property
    def workdir(self) -> Path: ...

    @property
    def failure(self) -> str | None:
        """Why the sandbox is FAILED (e.g. 'qemu exited with signal 9'), else None."""
        ...

    @property
    def pid(self) -> int | None:
        """The host process that holds the VM (its memory is the sandbox's), None once it is gone."""
        ...

    def on_failure(self, callback: Callable[[str], Awaitable[None] | None]) -> None:
        """Register a callback run once when the VM dies unexpectedly."""
        ...

    def set_background(self, background: bool) -> None:
        """Lowest CPU priority (True) or the normal one (False) for the whole VM, every thread of it."""
        ...


class Runtime(Protocol):
    """A VM driver. All methods are coroutines; drivers are used from one asyncio loop."""

    name: str

    async def boot(self, spec: VMSpec, sandbox_id: str | None = None) -> Sandbox:
        """Cold-boot a VM and return once its guest daemon answers. Leaves nothing behind on failure."""
        ...

    async def destroy(self, sandbox: Sandbox) -> None:
        """Stop the VM and delete everything it owned (process, disk copy, sockets, workdir). Idempotent."""
        ...

    def list(self) -> Sequence[Sandbox]: ...

    async def cleanup_orphans(self) -> builtins.list[str]:
        """Remove VMs/workdirs left by a previous node process; returns what was removed."""
        ...

    async def close(self) -> None:
        """Destroy every sandbox this runtime owns."""
        ...


@runtime_checkable
class SnapshotCapable(Protocol):
    """What a runtime that can snapshot offers on top of :class:`Runtime`.

    Snapshots taken without a ``dest`` live in the runtime's snapshot store and are addressed by id
    (``snap_...``); templates keep theirs under :attr:`templates_dir` and address them by path.
    """

    @property
    def can_snapshot(self) -> bool:
        """False when this instance has no snapshot storage (e.g. QEMU on plain work dirs): its snapshot
        operations then refuse with ``snapshot_unsupported``, and a node gets no snapshots part."""
        ...

    @property
    def templates_dir(self) -> Path:
        """Where template snapshots live (on the same storage as sandboxes, so restores are reflinks)."""
        ...

    async def snapshot(self, sandbox: Sandbox, dest: Path | str | None = None, *, resume: bool = True,
                       labels: dict[str, str] | None = None, content_digest: bool = False) -> Snapshot:
        """Snapshot a running sandbox into ``dest`` (a snapshot id, a directory, or None for a new id).
        ``resume=False`` leaves the VM stopped (pause: the caller destroys it next)."""
        ...

    async def restore(self, snapshot: Snapshot | Path | str, spec: VMSpec, *, sandbox_id: str | None = None,
                      ram_mode: RamMode = RamMode.COPY, refresh: bool = True,
                      ram_domain: str | None = None) -> Sandbox:
        """A new running sandbox from ``snapshot``; its guest gets fresh entropy and the host clock unless
        ``refresh=False``. ``ram_domain``: in :attr:`RamMode.PRIVATE`, the sandboxes that share the
        snapshot's RAM pages with this one are those restored with the same domain (None: the
        snapshot's own id, as for branches)."""
        ...

    async def branch(self, snapshot: Snapshot | Path | str, n: int, spec: VMSpec, *,
                     ram_mode: RamMode = RamMode.PRIVATE) -> Sequence[Sandbox]:
        """``n`` independent sandboxes restored concurrently from one snapshot. All or nothing."""
        ...

    def open_snapshot(self, snapshot_id: str) -> Snapshot:
        """The stored snapshot ``snapshot_id``; CapsaError ``snapshot_not_found`` (404) if the id is unknown
        or malformed."""
        ...

    def list_snapshot_ids(self) -> builtins.list[str]:
        """Ids of the snapshots in the store (unverified: opening one may still fail)."""
        ...

    def delete_snapshot(self, snapshot: Snapshot | str) -> bool:
        """Delete a stored snapshot; False if it did not exist."""
        ...

    def can_restore(self, snapshot: Snapshot, spec: VMSpec) -> bool:
        """Whether this runtime can restore ``snapshot`` as ``spec`` (same accelerator, QEMU and device
        layout, including a NIC with ``spec.network.mac``)."""
        ...


class SnapshottingRuntime(Runtime, SnapshotCapable, Protocol):
    """A VM driver that boots and snapshots (the QEMU runtime; the fast tests' fake runtime)."""

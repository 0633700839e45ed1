"""The runtime protocol: what every VM driver (QEMU microvm now, Firecracker later) provides.

The node agent only ever talks to a driver through these types; it never builds a QEMU command
line or speaks QMP itself. A driver returns :class:`Sandbox` handles; the guest is reached through
``sandbox.guest`` (a :class:`capsa.node.guest_client.GuestClient`).
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from capsa.common.errors import CapsaError
from capsa.common.image import GuestImage

if TYPE_CHECKING:
    from capsa.node.guest_client import GuestClient

__all__ = [
    "Accelerator",
    "BootError",
    "GuestImage",
    "Runtime",
    "RuntimeError_",
    "Sandbox",
    "SandboxFailed",
    "SandboxState",
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


@dataclass(frozen=True)
class VMSpec:
    image: GuestImage
    memory_mib: int = 256
    vcpus: int = 1
    disk_size_mib: int | None = None  # grow the private disk copy to this size; None keeps the image size
    network: object | None = None  # filled in by the egress work (capsa.node.net); None = no NIC at all
    kernel_args: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


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

    def on_failure(self, callback: Callable[[str], Awaitable[None] | None]) -> None:
        """Register a callback run once when the VM dies unexpectedly."""
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

    def list(self) -> list[Sandbox]: ...

    async def cleanup_orphans(self) -> builtins.list[str]:
        """Remove VMs/workdirs left by a previous node process; returns what was removed."""
        ...

    async def close(self) -> None:
        """Destroy every sandbox this runtime owns."""
        ...

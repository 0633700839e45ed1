"""One check's outcome (:class:`Check`, the shape of ``capsa doctor --json``), what the checks read
(:class:`DoctorConfig`), and the shared helpers: who QEMU runs as, running a short command."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.workdir import VM_UID_BASE
from capsa.node.storage.pool import StorageSettings

__all__ = ["Check", "DoctorConfig", "run_command", "vm_user"]


@dataclass(frozen=True)
class Check:
    """A check's outcome: ``ok``, what was found (``detail``, one line) and, when not ok, the one-line
    ``fix``. ``as_dict`` is one item of ``capsa doctor --json``'s ``checks``."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True)
class DoctorConfig:
    """What the checks look at: the node's settings (state and cache dirs, accelerator, store), its storage
    settings, the control plane's URL (None: not configured) and the guest image a KVM probe boot uses
    (None: not built yet, so only the device access can be checked)."""

    settings: Settings
    control_url: str | None = None
    image: GuestImage | None = None
    storage: StorageSettings = field(default_factory=StorageSettings)

    @property
    def state_dir(self) -> Path:
        return Path(os.path.abspath(self.settings.state_dir))


def vm_user() -> tuple[int, int] | None:
    """The user QEMU runs as, as the runtime picks it: a per-VM uid (all are alike towards the host, so
    the first stands for all) when the node is root, else the node's own user (None)."""
    return (VM_UID_BASE, VM_UID_BASE) if os.geteuid() == 0 else None


async def run_command(argv: Sequence[str], *, stdin: bytes | None = None,
                      within: float = 20.0) -> tuple[int, str]:
    """Run ``argv``; returns its exit status and its output (stdout then stderr, stripped). A missing
    program or a timeout is exit status 127 or 124 with the reason as output."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    except OSError as exc:
        return 127, f"{argv[0]}: {exc.strerror or exc}"
    try:
        async with asyncio.timeout(within):
            out, err = await proc.communicate(stdin)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"{argv[0]} did not finish within {within:g}s"
    text = (out.decode(errors="replace").strip() + "\n" + err.decode(errors="replace").strip()).strip()
    return proc.returncode if proc.returncode is not None else -1, text

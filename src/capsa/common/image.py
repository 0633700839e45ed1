"""The description of a built guest image, shared by the image builder and the VM runtimes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["GuestImage"]


@dataclass(frozen=True)
class GuestImage:
    """A built guest image: an ELF vmlinux, a gzip'd cpio initramfs and an ext4 root filesystem."""

    kernel: Path
    initrd: Path
    rootfs: Path
    digest: str
    kernel_release: str
    manifest: Path | None = None
    """The image's manifest.json (inputs, package versions, artifact digests), when built by capsa.images."""

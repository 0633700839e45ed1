"""The initramfs: busybox, the virtio modules and an /init that switch_roots into the root disk."""

from __future__ import annotations

import gzip
import io
from importlib import resources
from pathlib import Path

from capsa.images.cpio import CpioWriter
from capsa.images.modules import KernelModule

__all__ = ["BUSYBOX_APPLETS", "build_initramfs", "init_script"]

# The applets /init uses; linked explicitly so the script never depends on `busybox --install`.
BUSYBOX_APPLETS = ("sh", "mount", "umount", "insmod", "sleep", "cat", "echo", "poweroff", "switch_root")


def init_script() -> bytes:
    return resources.files("capsa.images").joinpath("data/init.sh").read_bytes()


def build_initramfs(busybox: Path, modules: list[KernelModule], out: Path) -> int:
    """Write a gzip'd newc cpio to ``out`` and return its size in bytes.

    The output is reproducible: the same busybox and modules give the same bytes.
    """
    raw = io.BytesIO()
    cpio = CpioWriter(raw)
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"):
        cpio.add_dir(d)
    # The kernel opens /dev/console for init's stdio before anything mounts devtmpfs.
    cpio.add_char_device("dev/console", 5, 1)
    cpio.add_file("bin/busybox", busybox.read_bytes(), 0o755)
    for applet in BUSYBOX_APPLETS:
        cpio.add_symlink(f"bin/{applet}", "busybox")
    for mod in modules:
        cpio.add_file(f"lib/modules/{mod.name}.ko", mod.read())
    cpio.add_file("lib/modules/order", "".join(f"{m.name}\n" for m in modules).encode())
    cpio.add_file("init", init_script(), 0o755)
    cpio.close()
    # Empty name and zero mtime keep the gzip header independent of when and where it was built.
    with out.open("wb") as f, gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0,
                                            compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.stat().st_size

"""Unpack an image of an OCI layout into a root filesystem directory with umoci.

``umoci raw unpack`` applies the layers in order and does what a hand-written tar loop gets wrong: OCI
whiteouts (``.wh.`` files and opaque directories), hard links, device nodes, ``../`` and absolute paths and
symlinks, all resolved inside the target directory. It runs as root so files keep their owners, modes
(setuid bits too) and device nodes; so the target's parent must be root's alone (no access for group or
others), or a device node or setuid binary of the image would be one for the host's users. What a hostile
layer leaves in the root filesystem is a test's finding (tests/integration/test_oci_pull.py), not something
this module checks.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from capsa.common.errors import CapsaError

__all__ = ["DEFAULT_TIMEOUT", "unpack_image"]

DEFAULT_TIMEOUT = 1800.0


def unpack_image(layout: Path, tag: str, rootfs: Path, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Unpack ``layout:tag`` into ``rootfs`` (which must not exist; its parent must, owned by root with no
    access for others). Errors are
    :class:`CapsaError` ``image_unpack_failed`` (500); on any failure ``rootfs`` is removed."""
    if os.geteuid() != 0:
        raise CapsaError("unpacking an image keeps its files' owners: the node must run as root",
                         code="image_unpack_failed", status=500)
    if ":" in str(layout):
        raise CapsaError(f"an OCI layout path has no ':' ({layout})", code="image_unpack_failed", status=500)
    if rootfs.exists() or rootfs.is_symlink():
        raise CapsaError(f"{rootfs} exists already", code="image_unpack_failed", status=500)
    try:
        parent = rootfs.parent.stat()
    except OSError:
        parent = None
    if parent is None or not stat.S_ISDIR(parent.st_mode):
        raise CapsaError(f"no directory {rootfs.parent} to unpack into", code="image_unpack_failed",
                         status=500)
    if parent.st_uid != 0 or parent.st_mode & 0o077:
        raise CapsaError(f"{rootfs.parent} must be root's alone (mode 0700) to unpack an image into",
                         code="image_unpack_failed", status=500)
    argv = ["umoci", "--log=error", "raw", "unpack", "--image", f"{layout}:{tag}", str(rootfs)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(rootfs, ignore_errors=True)
        raise CapsaError(f"unpacking {layout}:{tag} took longer than {timeout:.0f} s",
                         code="image_unpack_failed", status=500) from None
    except FileNotFoundError:
        raise CapsaError("umoci is not installed on this node (scripts/install.sh installs it)",
                         code="image_unpack_failed", status=500) from None
    if proc.returncode != 0:
        shutil.rmtree(rootfs, ignore_errors=True)
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1][-600:]
        raise CapsaError(f"umoci could not unpack {layout}:{tag}: {reason}", code="image_unpack_failed",
                         status=500)

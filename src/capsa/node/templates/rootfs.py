"""Debian packages of a template spec installed into a copy of the guest's root filesystem on the host.

Unpacking and configuring packages under TCG costs minutes (Chromium and its ~150 dependencies: about 10 min
in the build VM); natively it takes seconds. Only packages come in this way, from the host's configured apt
sources (the guest and the host are the same suite, bookworm), resolved against the guest's own dpkg status;
the spec's files and commands still go through the build VM, never the host.

``dpkg -i`` runs chrooted in the copy, inside new mount, PID, network, UTS and IPC namespaces: the loop mount,
``/proc`` and the package directory exist only there and vanish with it (even if the build is killed), the
maintainer scripts reach no network and no host process, and ``policy-rc.d`` keeps them from starting
services. Downloaded ``.deb`` files are kept in a cache directory and reused by later builds (apt checks
their hashes).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from capsa.common.errors import CapsaError

__all__ = ["RootfsError", "download_debs", "guest_dpkg_status", "install_debs"]

Progress = Callable[[str], None]

_DEB_DIR = "/var/tmp/capsa-debs"
# "Inst NAME [OLD] (VERSION ARCHIVES [ARCH]) [BROKEN...]" of apt-get --simulate
_INST_RE = re.compile(r"^Inst (?P<name>\S+) (?:\[\S+\] )?\((?P<version>\S+) [^\[]*\[(?P<arch>[a-z0-9]+)\]\)")

# Run as `sh -c SCRIPT sh IMAGE MOUNTPOINT DEBDIR` inside the new namespaces. The mounts are private to
# them; nothing needs unmounting on the way out. policy-rc.d: no service starts while packages configure.
# --force-unsafe-io: no fsync per unpacked file (the image is unmounted, hence written back, before use).
_INSTALL = r"""
set -eu
img=$1 mnt=$2 debs=$3
mount --make-rprivate /
mount -o loop "$img" "$mnt"
mount -t proc proc "$mnt/proc"
mkdir -p "$mnt/var/tmp/capsa-debs"
mount --bind -o ro "$debs" "$mnt/var/tmp/capsa-debs"
printf '#!/bin/sh\nexit 101\n' > "$mnt/usr/sbin/policy-rc.d"
chmod 755 "$mnt/usr/sbin/policy-rc.d"
chroot "$mnt" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    LC_ALL=C.UTF-8 HOME=/root \
    dpkg --force-confdef --force-confold --force-unsafe-io --recursive -i /var/tmp/capsa-debs
rm -f "$mnt/usr/sbin/policy-rc.d"
umount "$mnt/var/tmp/capsa-debs"
rmdir "$mnt/var/tmp/capsa-debs"
rm -rf "$mnt/var/cache/apt/archives/"*.deb "$mnt/var/lib/apt/lists/"* 2>/dev/null || :
umount "$mnt/proc"
umount "$mnt"
"""


class RootfsError(CapsaError):
    code = "template_build_failed"
    status = 500


def _run(argv: list[str], what: str, timeout: float = 1800.0) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RootfsError(f"{what} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise RootfsError(f"{what} failed: {tail}")
    return proc.stdout


def guest_dpkg_status(rootfs: Path) -> bytes:
    """The guest's dpkg status file, read from its ext4 image without mounting it."""
    out = subprocess.run(["debugfs", "-R", "cat /var/lib/dpkg/status", str(rootfs)], capture_output=True,
                         check=False, timeout=60)
    if out.returncode != 0 or not out.stdout.startswith(b"Package:"):
        raise RootfsError(f"cannot read the dpkg status of {rootfs}: {out.stderr.decode(errors='replace')}")
    return out.stdout


def download_debs(packages: list[str], guest_status: bytes, work: Path, archives: Path) -> list[Path]:
    """The .deb files of ``packages`` and of the dependencies the guest lacks (resolved against its dpkg
    status), downloaded into ``archives`` (a cache: files already there are reused)."""
    state = work / "apt-state"
    state.mkdir(parents=True)
    (state / "status").write_bytes(guest_status)
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    options = ["-q", "-y", "--no-install-recommends", "-o", f"Dir::State::status={state / 'status'}",
               "-o", f"Dir::Cache::archives={archives}", "-o", "Debug::NoLocking=1",
               "-o", "APT::Sandbox::User=root"]
    what = "apt download of " + " ".join(packages)
    plan = _run(["apt-get", *options, "--simulate", "install", "--", *packages], what)
    wanted = []
    for line in plan.splitlines():
        match = _INST_RE.match(line.strip())
        if match is not None:
            version = match["version"].replace(":", "%3a")
            wanted.append(f"{match['name']}_{version}_{match['arch']}.deb")
    if not wanted:
        return []
    _run(["apt-get", *options, "--download-only", "install", "--", *packages], what)
    missing = [name for name in wanted if not (archives / name).is_file()]
    if missing:
        raise RootfsError(f"{what}: apt did not leave {', '.join(missing[:5])} in {archives}")
    return [archives / name for name in wanted]


def install_debs(rootfs: Path, debs: list[Path], work: Path) -> str:
    """Install ``debs`` into the ext4 image ``rootfs`` (which no VM may be using); returns dpkg's output."""
    for tool in ("unshare", "chroot", "mount"):
        if shutil.which(tool) is None:
            raise RootfsError(f"`{tool}` is not installed (needed to install packages into a template)")
    debdir = work / "debs"
    debdir.mkdir()
    for deb in debs:
        shutil.copyfile(deb, debdir / deb.name)  # a private copy: the cache is shared with other builds
    mnt = work / "mnt"
    mnt.mkdir()
    return _run(["unshare", "--mount", "--pid", "--fork", "--kill-child", "--net", "--uts", "--ipc", "--",
                 "sh", "-c", _INSTALL, "sh", str(rootfs), str(mnt), str(debdir)],
                f"installing {len(debs)} package(s) into the template's root filesystem")

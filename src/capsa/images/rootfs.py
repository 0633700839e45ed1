"""The root filesystem: a debootstrap'd Debian base, the guest daemon on top, packed as ext4.

The debootstrap result is the expensive part (minutes), so it is stored as a tarball and reused
across images; everything after it (copying in the daemon, making the ext4) takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterable
from pathlib import Path

from capsa.images.errors import ImageBuildError

__all__ = [
    "GUEST_LIB_DIR",
    "dpkg_versions",
    "extract_base",
    "install_guest",
    "make_ext4",
    "run_debootstrap",
]

GUEST_LIB_DIR = "usr/lib/capsa"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _require(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise ImageBuildError(f"`{tool}` is not installed (needed to build the guest image)")
    return exe


def _run_logged(argv: list[str], log: Path, what: str) -> None:
    """Run ``argv`` in its own process group, output to ``log``; on any interruption kill the group.

    debootstrap forks dpkg and chroot'd maintainer scripts; killing only the direct child would
    leave them running and writing into a directory we are about to delete.
    """
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
    if rc != 0:
        raise ImageBuildError(f"{what} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            # The leader is gone; stragglers in the group still get the next signal.
        except subprocess.TimeoutExpired:
            continue


def _propagation() -> str:
    """``private`` where possible; ``unchanged`` inside a chroot, whose / is not a mount point.

    In the fallback case mounts can leak out of the namespace, so :func:`_unmount_under` cleans up.
    """
    probe = subprocess.run([_require("unshare"), "--mount", "--propagation", "private", "true"],
                           capture_output=True, check=False)
    return "private" if probe.returncode == 0 else "unchanged"


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    return points


def _unmount_under(path: Path) -> None:
    # Deepest first; lazy so a busy mount cannot keep the target (and its deletion) hostage.
    for point in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def run_debootstrap(*, suite: str, mirror: str, packages: Iterable[str], target: Path, tarball: Path,
                    debs_cache: Path, log: Path) -> None:
    """debootstrap a minbase system into ``target`` and pack it into ``tarball`` (tar + zstd).

    debootstrap runs in a private mount namespace (``unshare -m``): the /proc and /sys it mounts
    inside the target disappear with it even if it is killed, so deleting ``target`` afterwards can
    never reach into the host's /proc or /sys. Anything still mounted there is unmounted anyway.
    """
    if os.geteuid() != 0:
        raise ImageBuildError("building the guest root filesystem needs root (debootstrap, device nodes)")
    debs_cache.mkdir(parents=True, exist_ok=True)
    argv = [
        _require("unshare"), "--mount", "--propagation", _propagation(), "--",
        _require("debootstrap"), "--variant=minbase", f"--include={','.join(packages)}",
        f"--cache-dir={debs_cache}", suite, str(target), mirror,
    ]
    try:
        _run_logged(argv, log, "debootstrap")
    finally:
        _unmount_under(target)
    # Package downloads and apt lists are dead weight in a sandbox image.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "debootstrap"):
        d = target / sub
        if d.is_dir():
            for entry in d.iterdir():
                if entry.is_file() or entry.is_symlink():
                    entry.unlink()
    for f in ("var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin"):
        (target / f).unlink(missing_ok=True)
    _run_logged([_require("tar"), "--numeric-owner", "--xattrs", "--xattrs-include=*", "--zstd",
                 "-C", str(target), "-cf", str(tarball), "."], log, "packing the debootstrap result")


def extract_base(tarball: Path, target: Path, log: Path) -> None:
    target.mkdir(parents=True)
    _run_logged([_require("tar"), "--numeric-owner", "--xattrs", "--xattrs-include=*", "--zstd",
                 "-C", str(target), "-xpf", str(tarball)], log, "unpacking the base root filesystem")


def install_guest(root: Path, guest_files: dict[str, bytes], capsa_init: bytes,
                  hostname: str = "capsa") -> None:
    """Copy the guest daemon sources and /sbin/capsa-init into the unpacked root filesystem.

    ``guest_files`` maps paths relative to the ``capsa.guest`` package to their contents.
    """
    pkg = root / GUEST_LIB_DIR / "capsa"
    (pkg / "guest").mkdir(parents=True, exist_ok=True)
    # An empty parent package: the guest sees only capsa.guest, never the rest of capsa.
    (pkg / "__init__.py").write_bytes(b"")
    for rel, data in sorted(guest_files.items()):
        dest = pkg / "guest" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        dest.chmod(0o644)
    init = root / "sbin" / "capsa-init"
    init.write_bytes(capsa_init)
    init.chmod(0o755)
    (root / "etc" / "hostname").write_text(hostname + "\n")
    (root / "etc" / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost\n")
    # debootstrap copies the build host's resolver config; the guest's must not inherit it.
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text("")


def dpkg_versions(root: Path) -> dict[str, str]:
    """Installed package -> version, read from the root filesystem's dpkg status file."""
    versions: dict[str, str] = {}
    status = root / "var" / "lib" / "dpkg" / "status"
    for stanza in status.read_text(errors="replace").split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                k, v = line.split(":", 1)
                fields[k] = v.strip()
        if "Package" in fields and "Version" in fields and fields.get("Status", "").endswith(" installed"):
            versions[fields["Package"]] = fields["Version"]
    return dict(sorted(versions.items()))


def make_ext4(source: Path, out: Path, size_mib: int, seed: str, log: Path) -> None:
    """Make a sparse ext4 image of ``size_mib`` MiB holding ``source``'s tree (no mounting).

    ``seed`` fixes the filesystem UUID and directory hash seed so equal inputs give equal images.
    """
    fs_uuid = str(uuid.UUID(hashlib.sha256(seed.encode()).hexdigest()[:32]))
    with out.open("wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    _run_logged([
        _require("mke2fs"), "-q", "-F", "-t", "ext4", "-L", "capsa-root", "-m", "0",
        "-U", fs_uuid, "-E", f"hash_seed={fs_uuid},lazy_itable_init=0,root_owner=0:0",
        "-d", str(source), str(out),
    ], log, "mke2fs")

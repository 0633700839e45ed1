"""Installs the peers into the bench's own directory (default /var/cache/capsa/bench/peers).

* Debian packages are fetched one file at a time with the project's private apt configuration
  (:class:`capsa.images.apt.PrivateApt`: its own sources list and package lists under this directory), so
  no suite is ever added to /etc/apt, and unpacked with ``dpkg-deb -x`` (no maintainer scripts).
* runsc: bookworm's (20221219, ptrace only) and trixie's (20240729, systrap).
* nitrobox 0.1.0 only ships CPython >= 3.12 wheels and this host has 3.11, so trixie's python3.13 is
  unpacked together with trixie's own C library and started through that library's dynamic loader (a
  small wrapper script), then a virtualenv of it receives nitrobox from PyPI.
* llm-sandbox goes into a plain virtualenv of the host's python; its daemonless backend needs ``bwrap``,
  taken from bookworm's bubblewrap package.
* The OCI/nitrobox root filesystem is capsa's own guest rootfs, copied out of the image with
  ``debugfs rdump`` (no mount), so every peer runs the same Debian userland as the microVMs.

Each step leaves a ``.complete`` marker and is skipped when it is present; a failed step raises
:class:`PeerUnavailable` with the reason, which the benchmark records.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

from capsa.common.image import GuestImage
from capsa.images.apt import PrivateApt, dpkg_extract
from capsa.images.errors import ImageBuildError

__all__ = ["DEFAULT_DIR", "Installer", "PeerUnavailable"]

DEFAULT_DIR = Path("/var/cache/capsa/bench/peers")
MIRROR = "http://deb.debian.org/debian"
NITROBOX_VERSION = "0.1.0"
LLM_SANDBOX_VERSION = "0.3.46"

# python3.13 and the shared libraries it and its standard library's extension modules load, all from
# trixie: mixing them with bookworm's older libc would fail at load time.
_PY313_PACKAGES = (
    "python3.13-minimal", "libpython3.13-minimal", "libpython3.13-stdlib", "libc6", "libexpat1", "zlib1g",
    "libssl3t64", "libbz2-1.0", "libdb5.3t64", "libffi8", "liblzma5", "libncursesw6", "libreadline8t64",
    "libsqlite3-0", "libtinfo6", "libuuid1", "libzstd1", "libgcc-s1",
)


class PeerUnavailable(RuntimeError):
    """A peer cannot be installed or run on this host; the message says why."""


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise PeerUnavailable(f"{what} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


class Installer:
    def __init__(self, root: Path = DEFAULT_DIR) -> None:
        self.root = root

    def _apt(self, suite: str) -> PrivateApt:
        apt = PrivateApt(self.root / f"apt-{suite}", MIRROR, suite)
        apt.ensure_lists()
        return apt

    def _debs(self, suite: str, packages: tuple[str, ...], dest: Path) -> Path:
        """Unpack ``packages`` from ``suite`` into ``dest`` (cached)."""
        marker = dest / ".complete"
        if marker.exists():
            return dest
        try:
            apt = self._apt(suite)
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for name in packages:
                deb = apt.download(apt.candidate(name), self.root / "debs")
                dpkg_extract(deb, dest)
        except ImageBuildError as exc:
            raise PeerUnavailable(f"fetching {', '.join(packages)} from {suite}: {exc}") from exc
        marker.write_text(" ".join(packages) + "\n")
        return dest

    def runsc(self, suite: str) -> Path:
        exe = self._debs(suite, ("runsc",), self.root / f"runsc-{suite}") / "usr/bin/runsc"
        if not exe.exists():
            raise PeerUnavailable(f"{suite}'s runsc package has no usr/bin/runsc")
        return exe

    def bwrap(self) -> Path:
        return self._debs("bookworm", ("bubblewrap",), self.root / "bubblewrap") / "usr/bin/bwrap"

    def rootfs(self, image: GuestImage) -> Path:
        """capsa's guest root filesystem as a directory (read-only use by the peers)."""
        dest = self.root / f"rootfs-{image.digest[:16]}"
        if (dest / ".complete").exists():
            return dest
        if shutil.which("debugfs") is None:
            raise PeerUnavailable("debugfs (e2fsprogs) is not installed: cannot copy the guest rootfs out")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        _run(["debugfs", "-R", f"rdump / {dest}", str(image.rootfs)], "debugfs rdump of the guest rootfs")
        if not (dest / "usr/bin/true").exists():
            raise PeerUnavailable(f"the guest rootfs copied to {dest} has no /usr/bin/true")
        (dest / ".complete").write_text(image.digest + "\n")
        return dest

    def python313(self) -> Path:
        """A ``python3`` wrapper that runs trixie's python3.13 on trixie's own libc."""
        root = self._debs("trixie", _PY313_PACKAGES, self.root / "python3.13")
        libdir = root / "usr/lib/x86_64-linux-gnu"
        wrapper = root / "usr/bin/python3"
        # --argv0 "$0" keeps sys.executable pointing at the wrapper (or the venv's link to it), so
        # child interpreters and venv detection go through the same loader.
        wrapper.write_text(
            "#!/bin/sh\n"
            f'exec {libdir}/ld-linux-x86-64.so.2 --library-path {libdir} --argv0 "$0" '
            f'{root}/usr/bin/python3.13 "$@"\n')
        wrapper.chmod(0o755)
        return wrapper

    def host_venv(self) -> Path:
        """A virtualenv of the host's python for the peers that support it (llm-sandbox)."""
        dest = self.root / "venv"
        py = dest / "bin/python"
        if not py.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(dest)
        return py

    def _pip_dir(self) -> Path:
        """pip's package directory in the host venv; pure Python, so python3.13 can run it too."""
        py = self.host_venv()
        out = _run([str(py), "-c", "import os, pip; print(os.path.dirname(os.path.dirname(pip.__file__)))"],
                   "locating pip")
        return Path(out.strip())

    def llm_sandbox(self) -> Path:
        py = self.host_venv()
        marker = self.root / "venv" / f".llm-sandbox-{LLM_SANDBOX_VERSION}"
        if not marker.exists():
            _run([str(py), "-m", "pip", "install", "-q", f"llm-sandbox=={LLM_SANDBOX_VERSION}"],
                 "pip install llm-sandbox")
            marker.touch()
        return py

    def nitrobox(self) -> Path:
        dest = self.root / "nitrobox-venv"
        py = dest / "bin/python"
        marker = dest / f".nitrobox-{NITROBOX_VERSION}"
        if marker.exists():
            return py
        wrapper = self.python313()
        shutil.rmtree(dest, ignore_errors=True)
        _run([str(wrapper), "-m", "venv", "--without-pip", str(dest)], "python3.13 -m venv")
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        _run([str(py), str(self._pip_dir() / "pip"), "install", "-q", f"nitrobox=={NITROBOX_VERSION}"],
             "pip install nitrobox (python3.13)", env=env)
        _run([str(py), "-c", "import nitrobox"], "import nitrobox")
        marker.touch()
        return py


if __name__ == "__main__":
    # Install everything without benchmarking: python bench/peers/install.py
    inst = Installer()
    steps: list[Callable[[], Path]] = [lambda: inst.runsc("bookworm"), lambda: inst.runsc("trixie"),
                                       inst.bwrap, inst.llm_sandbox, inst.nitrobox]
    for step in steps:
        try:
            print(step())
        except PeerUnavailable as exc:
            print("unavailable:", exc, file=sys.stderr)

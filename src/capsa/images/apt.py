"""A private apt configuration for fetching single Debian packages.

The host's own apt sources are never touched or read: the builder keeps its own sources list,
package lists and state under the cache directory, so it sees exactly the configured mirror and
suite whatever the host is configured with (DESIGN.md §9: never add a suite to /etc/apt).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from capsa.images.errors import ImageBuildError

__all__ = ["DEBIAN_KEYRING", "PrivateApt", "ResolvedPackage", "dpkg_extract"]

DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")

_DEP_RE = re.compile(r"^\s*([a-z0-9][a-z0-9+.\-]*)(?:\s*\(\s*=\s*([^)\s]+)\s*\))?")


@dataclass(frozen=True)
class ResolvedPackage:
    name: str
    version: str

    @property
    def filename(self) -> str:
        # apt-get download escapes ':' (epochs) as %3a in the file name.
        return f"{self.name}_{self.version.replace(':', '%3a')}_amd64.deb"


class PrivateApt:
    def __init__(self, root: Path, mirror: str, suite: str) -> None:
        self.root = root
        self.mirror = mirror
        self.suite = suite

    def _options(self) -> list[str]:
        r = self.root
        return [
            "-o", f"Dir::Etc::SourceList={r / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", "Dir::Etc::Preferences=/nonexistent",
            "-o", "Dir::Etc::PreferencesParts=/nonexistent",
            "-o", f"Dir::State={r / 'state'}",
            "-o", f"Dir::State::Lists={r / 'lists'}",
            "-o", f"Dir::State::status={r / 'status'}",
            "-o", f"Dir::Cache={r / 'cache'}",
            "-o", "APT::Architecture=amd64",
            "-o", "APT::Architectures=amd64",
            # The directories are private to this builder, so apt's locking and its drop to the
            # _apt user only add permission noise.
            "-o", "Debug::NoLocking=1",
            "-o", "APT::Sandbox::User=root",
        ]

    def _prepare(self) -> None:
        for sub in ("lists/partial", "state", "cache/archives/partial"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "status").touch()
        signed = f"[signed-by={DEBIAN_KEYRING}] " if DEBIAN_KEYRING.exists() else ""
        (self.root / "sources.list").write_text(f"deb {signed}{self.mirror} {self.suite} main\n")

    def _run(self, tool: str, args: list[str], cwd: Path | None = None) -> str:
        exe = shutil.which(tool)
        if exe is None:
            raise ImageBuildError(f"`{tool}` is not installed (the image builder needs apt)")
        proc = subprocess.run([exe, *self._options(), *args], cwd=cwd, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ImageBuildError(f"{tool} {' '.join(args)} failed: " + " | ".join(err))
        return proc.stdout

    def has_lists(self) -> bool:
        return (self.root / "sources.list").exists() and any((self.root / "lists").glob("*_Packages*"))

    def update(self) -> None:
        self._prepare()
        self._run("apt-get", ["-q", "update"])

    def ensure_lists(self) -> None:
        if not self.has_lists():
            self.update()
        else:
            self._prepare()

    def candidate(self, package: str) -> ResolvedPackage:
        """The version apt would install of ``package`` from the configured suite."""
        out = self._run("apt-cache", ["show", "--no-all-versions", package])
        for line in out.splitlines():
            if line.startswith("Version:"):
                return ResolvedPackage(package, line.split(":", 1)[1].strip())
        raise ImageBuildError(f"package {package} has no candidate version in {self.suite}")

    def resolve_metapackage(self, package: str, prefix: str) -> ResolvedPackage:
        """Follow a metapackage (e.g. linux-image-cloud-amd64) to the concrete package it depends on."""
        out = self._run("apt-cache", ["show", "--no-all-versions", package])
        for line in out.splitlines():
            if not line.startswith("Depends:"):
                continue
            for dep in line.split(":", 1)[1].split(","):
                m = _DEP_RE.match(dep.split("|")[0])
                if m and m.group(1).startswith(prefix) and m.group(1) != package:
                    name = m.group(1)
                    return ResolvedPackage(name, m.group(2)) if m.group(2) else self.candidate(name)
        raise ImageBuildError(f"metapackage {package} does not depend on a {prefix}* package")

    def download(self, pkg: ResolvedPackage, dest_dir: Path) -> Path:
        """Download ``pkg`` into ``dest_dir`` (kept there as a cache) and return the .deb path."""
        dest = dest_dir / pkg.filename
        if dest.exists():
            return dest
        dest_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download-") as tmp:
            try:
                self._run("apt-get", ["-q", "download", f"{pkg.name}={pkg.version}"], cwd=Path(tmp))
            except ImageBuildError:
                # Stale package lists point at files the mirror has since dropped: refresh once.
                self.update()
                self._run("apt-get", ["-q", "download", f"{pkg.name}={pkg.version}"], cwd=Path(tmp))
            got = sorted(Path(tmp).glob("*.deb"))
            if len(got) != 1:
                raise ImageBuildError(f"apt-get download {pkg.name} produced {len(got)} files")
            got[0].rename(dest)
        return dest


def dpkg_extract(deb: Path, dest: Path) -> None:
    """Unpack a .deb's data into ``dest`` (no maintainer scripts run)."""
    proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise ImageBuildError(f"dpkg-deb -x {deb.name} failed: {proc.stderr.strip()}")

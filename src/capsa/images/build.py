"""Building, caching and finding the guest image (the public entry points are re-exported by
``capsa.images``).

Two keys decide what is reused:

* the **config digest** covers everything capsa itself decides — suite, mirror, package lists,
  kernel modules, disk size, and the bytes of the guest daemon, the init scripts and this builder.
  :func:`find_image` looks images up by it without touching the network;
* the **image key** adds what the mirror decided when the image was built (the concrete kernel and
  busybox versions and the debootstrap base). It names the image directory and is the image digest.

A Debian point release therefore does not silently rebuild a working image; ``force=True`` (or
``capsa image build --force``) refreshes the package lists and rebuilds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.images.apt import PrivateApt, dpkg_extract
from capsa.images.cache import CacheLayout, digest_json
from capsa.images.errors import ImageBuildError
from capsa.images.initramfs import build_initramfs
from capsa.images.kernel import extract_vmlinux
from capsa.images.modules import find_kernel_release, resolve_modules
from capsa.images.progress import BuildEvent, ProgressCallback, StepState
from capsa.images.rootfs import dpkg_versions, extract_base, install_guest, make_ext4, run_debootstrap

__all__ = [
    "BUILDER_VERSION",
    "ImageConfig",
    "config_inputs",
    "ensure_image",
    "find_image",
    "image_from_manifest",
    "load_manifest",
]

BUILDER_VERSION = 1
KERNEL_FILE = "vmlinux"
INITRD_FILE = "initrd.cpio.gz"
ROOTFS_FILE = "rootfs.ext4"
MANIFEST_FILE = "manifest.json"
KEEP_IMAGES = 4
KEEP_RECENT = timedelta(hours=6)
"""Images beyond the newest KEEP_IMAGES are pruned once they are older than KEEP_RECENT."""


@dataclass(frozen=True)
class ImageConfig:
    """What capsa asks for; every field is part of the config digest."""

    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    kernel_package: str = "linux-image-cloud-amd64"
    packages: tuple[str, ...] = ("python3", "ca-certificates", "iproute2")
    # virtio_ring before virtio (RECIPES.md); dependencies found in .modinfo are added first.
    modules: tuple[str, ...] = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_net",
                                "virtio_console")
    rootfs_size_mib: int = 2048
    cache_dir: Path = field(default=Path("/var/cache/capsa"), compare=False)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> ImageConfig:
        s = settings if settings is not None else Settings()
        return cls(suite=s.debian_suite, mirror=s.debian_mirror.rstrip("/"), cache_dir=s.cache_dir)


def _package_files(package: str) -> Iterator[tuple[str, Path]]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImageBuildError(f"cannot locate the {package} package")
    root = Path(next(iter(spec.submodule_search_locations)))
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and not path.name.endswith(".pyc"):
            yield path.relative_to(root).as_posix(), path


def guest_sources() -> dict[str, bytes]:
    """The files of the capsa.guest package (relative path -> bytes) that go into the image."""
    return {rel: p.read_bytes() for rel, p in _package_files("capsa.guest") if rel.endswith(".py")}


def capsa_init_script() -> bytes:
    return resources.files("capsa.images").joinpath("data/capsa-init").read_bytes()


def config_inputs(config: ImageConfig) -> dict[str, Any]:
    """Everything the config digest covers, in a JSON-friendly form (recorded in the manifest)."""
    sources = {f"guest/{rel}": hashlib.sha256(data).hexdigest() for rel, data in guest_sources().items()}
    for rel, path in _package_files("capsa.images"):
        sources[f"images/{rel}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {
        "builder_version": BUILDER_VERSION,
        "suite": config.suite,
        "mirror": config.mirror,
        "kernel_package": config.kernel_package,
        "packages": list(config.packages),
        "modules": list(config.modules),
        "rootfs_size_mib": config.rootfs_size_mib,
        "sources": dict(sorted(sources.items())),
    }


def load_manifest(image_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((image_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def image_from_manifest(image_dir: Path, manifest: dict[str, Any]) -> GuestImage | None:
    """The GuestImage described by ``manifest`` if all its artifacts are present and intact in size."""
    try:
        artifacts = manifest["artifacts"]
        for name in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE):
            if (image_dir / name).stat().st_size != artifacts[name]["size"]:
                return None
        return GuestImage(
            kernel=image_dir / KERNEL_FILE,
            initrd=image_dir / INITRD_FILE,
            rootfs=image_dir / ROOTFS_FILE,
            digest=str(manifest["digest"]),
            kernel_release=str(manifest["kernel"]["release"]),
            manifest=image_dir / MANIFEST_FILE,
        )
    except (OSError, KeyError, TypeError):
        return None


def _find(layout: CacheLayout, config_digest: str) -> GuestImage | None:
    best: tuple[str, GuestImage] | None = None
    if not layout.images.is_dir():
        return None
    for image_dir in layout.images.iterdir():
        manifest = load_manifest(image_dir)
        if manifest is None or manifest.get("config_digest") != config_digest:
            continue
        image = image_from_manifest(image_dir, manifest)
        built_at = str(manifest.get("built_at", ""))
        if image is not None and (best is None or built_at > best[0]):
            best = (built_at, image)
    return best[1] if best else None


def find_image(settings: Settings | None = None) -> GuestImage | None:
    """The cached image built from the current inputs, or None. Never builds, never uses the network."""
    config = ImageConfig.from_settings(settings)
    return _find(CacheLayout(config.cache_dir), digest_json(config_inputs(config)))


def ensure_image(settings: Settings | None = None, progress: ProgressCallback | None = None,
                 force: bool = False) -> GuestImage:
    """Return the image for the current inputs, building it first if it is not cached.

    Concurrent callers serialize on the cache's build lock; the second one finds the first one's
    image. ``force`` refreshes the package lists and rebuilds even if a matching image exists.
    """
    config = ImageConfig.from_settings(settings)
    if not force:
        found = find_image(settings)
        if found is not None:
            return found
    return _Builder(config, progress).build(force)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _artifact(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"sha256": _sha256_file(path), "size": st.st_size, "allocated": st.st_blocks * 512}


class _Builder:
    def __init__(self, config: ImageConfig, progress: ProgressCallback | None) -> None:
        self.config = config
        self.layout = CacheLayout(config.cache_dir)
        self.progress = progress
        self.steps: dict[str, dict[str, Any]] = {}
        self._started: dict[str, float] = {}
        self._current = ""

    def _emit(self, step: str, state: StepState, detail: str = "") -> None:
        now = time.monotonic()
        if state is StepState.STARTED:
            self._started[step] = now
        elif state in (StepState.DONE, StepState.CACHED):
            self._current = ""
            took = now - self._started.get(step, now)
            self.steps[step] = {"seconds": round(took, 3), "cached": state is StepState.CACHED}
        if self.progress is not None:
            self.progress(BuildEvent(step, state, detail))

    def build(self, force: bool) -> GuestImage:
        try:
            return self._locked_build(force)
        except OSError as exc:
            # Permissions, a full disk, a vanished file: say where, without a traceback.
            step = f" during {self._current}" if self._current else ""
            raise ImageBuildError(f"image build failed{step}: {exc} (cache: {self.layout.root}; "
                                  "building needs root, or set CAPSA_CACHE_DIR)") from exc

    def _locked_build(self, force: bool) -> GuestImage:
        inputs = config_inputs(self.config)
        config_digest = digest_json(inputs)
        with self.layout.build_lock():
            if not force:
                # Someone else may have built it while we waited for the lock.
                found = _find(self.layout, config_digest)
                if found is not None:
                    return found
            try:
                with self.layout.workdir("build-") as work:
                    return self._build(work, inputs, config_digest, force)
            except BaseException as exc:
                if self._current:
                    why = str(exc) if isinstance(exc, Exception) else "interrupted"
                    self._emit(self._current, StepState.FAILED, why)
                raise

    def _prune(self, keep: Path) -> None:
        """Drop images beyond the newest KEEP_IMAGES that are also older than KEEP_RECENT.

        Each image is ~300 MiB on disk. Recent ones are kept whatever their number because a test
        session or node may still hold a GuestImage for them (a rebuild happens on every change to
        the guest sources); a running VM is unaffected either way, as it works on its own disk copy.
        """
        now = datetime.now(UTC)
        dated: list[tuple[datetime, Path]] = []
        for image_dir in self.layout.images.iterdir():
            manifest = load_manifest(image_dir)
            try:
                built = datetime.fromisoformat(str(manifest["built_at"])) if manifest else None
            except (KeyError, ValueError):
                built = None
            dated.append((built or datetime.min.replace(tzinfo=UTC), image_dir))
        dated.sort(reverse=True)
        for built, image_dir in dated[KEEP_IMAGES:]:
            if image_dir != keep and now - built > KEEP_RECENT:
                self.layout.discard(image_dir)

    def _step(self, name: str) -> None:
        self._current = name
        self._emit(name, StepState.STARTED)

    def _build(self, work: Path, inputs: dict[str, Any], config_digest: str, force: bool) -> GuestImage:
        c, layout = self.config, self.layout
        t0 = time.monotonic()
        log = work / "build.log"
        out = work / "image"
        out.mkdir()

        self._step("download")
        apt = PrivateApt(layout.apt(c.mirror, c.suite), c.mirror, c.suite)
        if force:
            apt.update()
        else:
            apt.ensure_lists()
        kernel_pkg = apt.resolve_metapackage(c.kernel_package, "linux-image-")
        busybox_pkg = apt.candidate("busybox-static")
        cached = all((layout.debs / p.filename).exists() for p in (kernel_pkg, busybox_pkg))
        kernel_deb = apt.download(kernel_pkg, layout.debs)
        busybox_deb = apt.download(busybox_pkg, layout.debs)
        self._emit("download", StepState.CACHED if cached else StepState.DONE,
                   f"{kernel_pkg.name} {kernel_pkg.version}, busybox-static {busybox_pkg.version}")

        self._step("extract")
        kroot, broot = work / "kernel-deb", work / "busybox-deb"
        dpkg_extract(kernel_deb, kroot)
        dpkg_extract(busybox_deb, broot)
        release = find_kernel_release(kroot)
        vmlinuz = kroot / "boot" / f"vmlinuz-{release}"
        if not vmlinuz.exists():
            raise ImageBuildError(f"{kernel_pkg.name} has no /boot/vmlinuz-{release}")
        elf, compression = extract_vmlinux(vmlinuz)
        (out / KERNEL_FILE).write_bytes(elf)
        del elf
        modules = resolve_modules(kroot / "lib" / "modules" / release, list(c.modules))
        busybox = broot / "bin" / "busybox"
        if not busybox.exists():
            raise ImageBuildError("busybox-static has no /bin/busybox")
        self._emit("extract", StepState.DONE, f"kernel {release} ({compression}), {len(modules)} modules")

        self._step("debootstrap")
        base_inputs = {"format": 1, "suite": c.suite, "mirror": c.mirror, "packages": sorted(c.packages),
                       "kernel": f"{kernel_pkg.name}={kernel_pkg.version}"}
        base_key = digest_json(base_inputs)
        tarball = layout.base_tarball(base_key)
        if tarball.exists() and not force:
            self._emit("debootstrap", StepState.CACHED, tarball.name)
        else:
            with layout.workdir("debootstrap-") as dwork:
                part = dwork / "base.tar.zst"
                run_debootstrap(suite=c.suite, mirror=c.mirror, packages=c.packages, target=dwork / "root",
                                tarball=part, debs_cache=layout.debootstrap_debs, log=log)
                (dwork / "base.json").write_text(json.dumps(base_inputs, indent=2) + "\n")
                layout.publish(dwork / "base.json", tarball.with_suffix("").with_suffix(".json"))
                layout.publish(part, tarball)
            self._emit("debootstrap", StepState.DONE, tarball.name)

        self._step("initramfs")
        build_initramfs(busybox, modules, out / INITRD_FILE)
        shutil.rmtree(kroot)
        shutil.rmtree(broot)
        self._emit("initramfs", StepState.DONE, " ".join(m.name for m in modules))

        self._step("rootfs")
        root = work / "root"
        extract_base(tarball, root, log)
        install_guest(root, guest_sources(), capsa_init_script())
        packages = dpkg_versions(root)
        self._emit("rootfs", StepState.DONE, f"{len(packages)} packages")

        image_key = digest_json({
            "config_digest": config_digest,
            "kernel": f"{kernel_pkg.name}={kernel_pkg.version}",
            "busybox": busybox_pkg.version,
            "base": base_key,
        })

        self._step("ext4")
        make_ext4(root, out / ROOTFS_FILE, c.rootfs_size_mib, image_key, log)
        shutil.rmtree(root)
        self._emit("ext4", StepState.DONE, f"{c.rootfs_size_mib} MiB")

        manifest = {
            "digest": image_key,
            "config_digest": config_digest,
            "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "build_seconds": round(time.monotonic() - t0, 3),
            "built_on": {"host": platform.node(), "pid": os.getpid()},
            "inputs": inputs,
            "kernel": {"package": kernel_pkg.name, "version": kernel_pkg.version, "release": release,
                       "compression": compression},
            "busybox": {"package": busybox_pkg.name, "version": busybox_pkg.version},
            "initramfs_modules": [{"name": m.name, "depends": list(m.depends)} for m in modules],
            "base": {"key": base_key, "tarball": str(tarball), "inputs": base_inputs},
            "packages": packages,
            "steps": self.steps,
            "artifacts": {name: _artifact(out / name) for name in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE)},
        }
        (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        dest = layout.image_dir(image_key)
        layout.publish(out, dest)
        self._prune(keep=dest)
        image = image_from_manifest(dest, manifest)
        if image is None:
            raise ImageBuildError(f"the image published at {dest} is incomplete")
        return image


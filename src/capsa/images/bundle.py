"""Guest images shipped as bundles: a built image directory packed into one sparse tar + zstd file, which a
node unpacks into its image cache instead of building the image (the container image carries one, see
scripts/build_image.py).

A bundle is ``<bundle_dir>/<config digest>.tar.zst`` holding ``<image digest>/`` with the image's files
(``vmlinux``, ``initrd.cpio.gz``, ``rootfs.ext4``, ``manifest.json``). Its name says which capsa sources it
was built for, so a node only ever unpacks the bundle :func:`~capsa.images.build.find_image` would find
afterwards; the 2 GiB root filesystem is kept sparse both in the tar and once unpacked (~250 MiB on disk).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.images.build import ImageConfig, config_inputs, find_image, image_from_manifest, load_manifest
from capsa.images.cache import CacheLayout, digest_json
from capsa.images.errors import ImageBuildError

__all__ = ["BUNDLE_SUFFIX", "bundle_path", "install_bundled_image", "pack_image"]

BUNDLE_SUFFIX = ".tar.zst"


def bundle_path(bundle_dir: Path, config_digest: str) -> Path:
    """Where the bundle of an image built for ``config_digest`` lives in ``bundle_dir``."""
    return bundle_dir / f"{config_digest}{BUNDLE_SUFFIX}"


def _tar() -> str:
    exe = shutil.which("tar")
    if exe is None or shutil.which("zstd") is None:
        raise ImageBuildError("`tar` and `zstd` are needed to pack or unpack a guest image bundle")
    return exe


def pack_image(image: GuestImage, out: Path, mtime: int) -> Path:
    """Pack ``image``'s directory into the bundle file ``out`` (sparse, sorted, owned by 0:0, every time
    ``mtime``: equal images give equal bundles). Returns ``out``."""
    image_dir = image.kernel.parent
    manifest = load_manifest(image_dir)
    if manifest is None:
        raise ImageBuildError(f"{image_dir} has no manifest: not an image built by capsa")
    part = out.with_name(out.name + ".tmp")
    # Sparse format 0.0: 0.1 and 1.0 name each sparse member after tar's pid (GNUSparseFile.<pid>/...).
    proc = subprocess.run(
        [_tar(), "--sparse", "--sparse-version=0.0", "--format=pax", "--sort=name", f"--mtime=@{mtime}",
         "--owner=0", "--group=0", "--numeric-owner",
         "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
         "--zstd", "-C", str(image_dir.parent), "-cf", str(part), image_dir.name],
        capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        part.unlink(missing_ok=True)
        raise ImageBuildError(f"packing {image_dir} failed: {proc.stderr.strip()}")
    part.rename(out)
    return out


def install_bundled_image(settings: Settings, bundle_dir: Path) -> GuestImage | None:
    """Unpack the bundle made for this capsa's guest sources into the image cache and return the image;
    None when ``bundle_dir`` has no such bundle. Concurrent callers serialize on the cache's build lock
    (the second finds the first one's image)."""
    config = ImageConfig.from_settings(settings)
    config_digest = digest_json(config_inputs(config))
    bundle = bundle_path(bundle_dir, config_digest)
    if not bundle.is_file():
        return None
    layout = CacheLayout(config.cache_dir)
    with layout.build_lock():
        found = find_image(settings)
        if found is not None:
            return found
        with layout.workdir("bundle-") as work:
            proc = subprocess.run([_tar(), "--zstd", "-C", str(work), "-xf", str(bundle)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise ImageBuildError(f"unpacking {bundle} failed: {proc.stderr.strip()}")
            dirs = [p for p in work.iterdir() if p.is_dir()]
            manifest = load_manifest(dirs[0]) if len(dirs) == 1 else None
            if manifest is None or manifest.get("config_digest") != config_digest:
                raise ImageBuildError(f"{bundle} does not hold one image built for config {config_digest}")
            if image_from_manifest(dirs[0], manifest) is None:
                raise ImageBuildError(f"{bundle} holds an incomplete image")
            layout.publish(dirs[0], layout.image_dir(str(manifest["digest"])))
    return find_image(settings)

"""Guest image bundles (capsa.images.bundle): packed with the real tar and zstd, unpacked into an empty cache
where find_image then finds the image, its root filesystem still sparse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capsa.common.settings import Settings
from capsa.images.build import ImageConfig, config_inputs, find_image, image_from_manifest
from capsa.images.bundle import bundle_path, install_bundled_image, pack_image
from capsa.images.cache import digest_json
from capsa.images.errors import ImageBuildError

ROOTFS_MIB = 64


def _built_image(cache: Path, config_digest: str) -> Path:
    """An image directory as the builder publishes it: a sparse root filesystem with 1 MiB of data."""
    key = "ab" * 32
    image_dir = cache / "images" / key
    image_dir.mkdir(parents=True)
    (image_dir / "vmlinux").write_bytes(b"\x7fELF" + b"k" * 1000)
    (image_dir / "initrd.cpio.gz").write_bytes(b"initrd" * 100)
    with (image_dir / "rootfs.ext4").open("wb") as f:
        f.truncate(ROOTFS_MIB << 20)
        f.seek(8 << 20)
        f.write(bytes(range(256)) * 4096)
    names = ("vmlinux", "initrd.cpio.gz", "rootfs.ext4")
    sizes = {n: {"size": (image_dir / n).stat().st_size} for n in names}
    manifest = {"digest": key, "config_digest": config_digest, "built_at": "2026-01-01T00:00:00+00:00",
                "kernel": {"release": "6.1.0-test-cloud-amd64"}, "artifacts": sizes}
    (image_dir / "manifest.json").write_text(json.dumps(manifest))
    return image_dir


def _current_digest(cache: Path) -> str:
    return digest_json(config_inputs(ImageConfig.from_settings(Settings(cache_dir=cache))))


def _pack(tmp_path: Path, config_digest: str, name: str | None = None) -> Path:
    built = tmp_path / "built"
    image_dir = _built_image(built, config_digest)
    image = image_from_manifest(image_dir, json.loads((image_dir / "manifest.json").read_text()))
    assert image is not None
    bundles = tmp_path / "bundles"
    bundles.mkdir(exist_ok=True)
    return pack_image(image, bundle_path(bundles, name or config_digest), mtime=1_700_000_000)


def test_a_bundle_unpacks_into_the_cache_where_find_image_finds_it_sparse(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    settings = Settings(cache_dir=cache)
    bundle = _pack(tmp_path, _current_digest(cache))
    assert bundle.stat().st_size < 2 << 20  # the 64 MiB file is packed as its data
    assert find_image(settings) is None

    image = install_bundled_image(settings, bundle.parent)
    assert image is not None and image == find_image(settings)
    assert image.kernel_release == "6.1.0-test-cloud-amd64"
    rootfs = image.rootfs.stat()
    assert rootfs.st_size == ROOTFS_MIB << 20
    assert rootfs.st_blocks * 512 < 4 << 20, "the root filesystem was unpacked with its holes filled"
    assert not list((cache / "tmp").iterdir())
    # A second call (another node on the same cache) finds it without unpacking again.
    assert install_bundled_image(settings, bundle.parent) == image


def test_equal_images_give_equal_bundles(tmp_path: Path) -> None:
    digest = _current_digest(tmp_path)
    one = _pack(tmp_path / "one", digest).read_bytes()
    two = _pack(tmp_path / "two", digest).read_bytes()
    assert one == two


def test_no_bundle_for_these_sources_is_none(tmp_path: Path) -> None:
    _pack(tmp_path, "0" * 64)  # built for other guest sources
    settings = Settings(cache_dir=tmp_path / "cache")
    assert install_bundled_image(settings, tmp_path / "bundles") is None
    assert install_bundled_image(settings, tmp_path / "absent") is None


def test_a_bundle_holding_an_image_of_other_sources_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _pack(tmp_path, "0" * 64, name=_current_digest(cache))  # renamed: its manifest says otherwise
    with pytest.raises(ImageBuildError, match="does not hold one image built for config"):
        install_bundled_image(Settings(cache_dir=cache), tmp_path / "bundles")
    assert find_image(Settings(cache_dir=cache)) is None

"""The real image pipeline: artifacts, manifest, layered cache and interrupted builds.

These tests use the real cache (building the image once if needed) and, for the cache behaviour,
a private cache seeded with hard links to the real cache's package downloads and debootstrap base.
"""

from __future__ import annotations

import _thread
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.images import BuildEvent, StepState, ensure_image, find_image, load_manifest
from capsa.images import build as build_mod
from capsa.images.build import capsa_init_script, guest_sources
from capsa.images.initramfs import init_script

CAPSA = str(Path(sys.executable).with_name("capsa"))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="building the guest image needs root")


def _debugfs_cat(image: Path, path: str) -> bytes:
    proc = subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True, check=True)
    return proc.stdout


def _debugfs_stat(image: Path, path: str) -> str:
    proc = subprocess.run(["debugfs", "-R", f"stat {path}", str(image)], capture_output=True, text=True,
                          check=True)
    return proc.stdout + proc.stderr


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem (e.g. /tmp on tmpfs)
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    if src.exists():
        shutil.copytree(src, dst, copy_function=_link_or_copy, symlinks=True)


@pytest.fixture
def seeded_cache(guest_image: GuestImage, tmp_path: Path) -> Path:
    """A private cache holding the real cache's apt lists, .debs and debootstrap bases, but no image."""
    real = Settings().cache_dir
    cache = tmp_path / "cache"
    cache.mkdir()
    for sub in ("apt", "debs", "debootstrap-debs", "base"):
        _link_tree(real / sub, cache / sub)
    return cache


def test_manifest_describes_the_artifacts(guest_image: GuestImage) -> None:
    assert guest_image.manifest is not None
    manifest = load_manifest(guest_image.manifest.parent)
    assert manifest is not None
    assert manifest["digest"] == guest_image.digest == guest_image.kernel.parent.name
    assert manifest["kernel"]["release"] == guest_image.kernel_release
    assert guest_image.kernel_release.endswith("-cloud-amd64")
    assert manifest["kernel"]["package"] == f"linux-image-{guest_image.kernel_release}"
    for name, path in (("vmlinux", guest_image.kernel), ("initrd.cpio.gz", guest_image.initrd),
                       ("rootfs.ext4", guest_image.rootfs)):
        art = manifest["artifacts"][name]
        assert path.stat().st_size == art["size"]
        assert _sha256(path) == art["sha256"]
    # The rootfs is sparse: 2 GiB of address space, a few hundred MiB on disk.
    rootfs = manifest["artifacts"]["rootfs.ext4"]
    assert rootfs["size"] == manifest["inputs"]["rootfs_size_mib"] * 2**20
    assert rootfs["allocated"] < rootfs["size"] // 2
    assert {"python3", "ca-certificates", "iproute2"} <= set(manifest["packages"])
    assert set(manifest["steps"]) == {"download", "extract", "debootstrap", "initramfs", "rootfs", "ext4"}
    # find_image agrees with what ensure_image returned.
    assert find_image(Settings()) == guest_image


def test_kernel_is_elf_for_pvh_boot(guest_image: GuestImage) -> None:
    with guest_image.kernel.open("rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and head[4] == 2  # 64-bit
    assert int.from_bytes(head[18:20], "little") == 62  # x86-64


def test_initramfs_holds_busybox_modules_and_init(guest_image: GuestImage, tmp_path: Path) -> None:
    raw = gzip.decompress(guest_image.initrd.read_bytes())
    listing = subprocess.run(["cpio", "-it", "--quiet"], input=raw, capture_output=True, check=True)
    names = set(listing.stdout.decode().split())
    manifest = load_manifest(guest_image.kernel.parent)
    assert manifest is not None
    modules = [m["name"] for m in manifest["initramfs_modules"]]
    assert {"init", "bin/busybox", "bin/sh", "dev/console", "lib/modules/order"} <= names
    assert {f"lib/modules/{m}.ko" for m in modules} <= names
    assert modules.index("virtio_ring") < modules.index("virtio") < modules.index("virtio_mmio")
    assert modules.index("failover") < modules.index("net_failover") < modules.index("virtio_net")
    subprocess.run(["cpio", "-id", "--quiet", "init", "lib/modules/order"], input=raw, cwd=tmp_path,
                   check=True)
    assert (tmp_path / "init").read_bytes() == init_script()
    assert (tmp_path / "lib/modules/order").read_text().split() == modules


def test_rootfs_holds_the_guest_package(guest_image: GuestImage) -> None:
    rootfs = guest_image.rootfs
    assert _debugfs_cat(rootfs, "/sbin/capsa-init") == capsa_init_script()
    assert "Mode:  0755" in _debugfs_stat(rootfs, "/sbin/capsa-init")
    assert _debugfs_cat(rootfs, "/usr/lib/capsa/capsa/__init__.py") == b""
    for rel, data in guest_sources().items():
        assert _debugfs_cat(rootfs, f"/usr/lib/capsa/capsa/guest/{rel}") == data, rel
    assert "Type: regular" in _debugfs_stat(rootfs, "/usr/bin/python3.11")
    assert _debugfs_cat(rootfs, "/etc/hostname") == b"capsa\n"
    # No package downloads or apt lists left behind in the image.
    listing = subprocess.run(["debugfs", "-R", "ls -l /var/cache/apt/archives", str(rootfs)],
                             capture_output=True, text=True, check=True).stdout
    assert ".deb" not in listing


def test_changing_guest_sources_reruns_only_the_cheap_steps(
        seeded_cache: Path, guest_image: GuestImage, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(cache_dir=seeded_cache)
    marker = b"# added by test_changing_guest_sources\nVALUE = 42\n"
    real_sources = guest_sources()
    monkeypatch.setattr(build_mod, "guest_sources", lambda: {**real_sources, "zz_test_marker.py": marker})
    assert find_image(settings) is None
    events: list[BuildEvent] = []
    image = ensure_image(settings, progress=events.append)
    states = {e.step: e.state for e in events if e.state is not StepState.STARTED}
    assert states["debootstrap"] is StepState.CACHED
    assert states["download"] is StepState.CACHED
    assert image.digest != guest_image.digest
    assert _debugfs_cat(image.rootfs, "/usr/lib/capsa/capsa/guest/zz_test_marker.py") == marker
    manifest = load_manifest(image.kernel.parent)
    assert manifest is not None
    assert manifest["steps"]["debootstrap"]["cached"] is True
    # The same inputs now resolve to the image just built, without building again.
    again: list[BuildEvent] = []
    assert ensure_image(settings, progress=again.append) == image
    assert again == []
    assert list((seeded_cache / "tmp").iterdir()) == []


def _cache_state(cache: Path) -> dict[str, list[str]]:
    return {sub: sorted(p.name for p in (cache / sub).iterdir()) if (cache / sub).exists() else []
            for sub in ("images", "base", "tmp")}


def test_interrupted_build_leaves_no_image(seeded_cache: Path) -> None:
    settings = Settings(cache_dir=seeded_cache)
    before = _cache_state(seeded_cache)

    def interrupt_in_ext4(event: BuildEvent) -> None:
        if event.step == "ext4" and event.state is StepState.STARTED:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_image(settings, progress=interrupt_in_ext4)
    after = _cache_state(seeded_cache)
    assert after["images"] == [] and after["tmp"] == []
    assert after["base"] == before["base"]
    assert find_image(settings) is None


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_interrupted_debootstrap_leaves_nothing(seeded_cache: Path) -> None:
    """Kill the build while the real debootstrap runs: no processes, mounts, base or image remain."""
    shutil.rmtree(seeded_cache / "base")
    settings = Settings(cache_dir=seeded_cache)
    timer: list[threading.Timer] = []

    def interrupt_during_debootstrap(event: BuildEvent) -> None:
        if event.step == "debootstrap" and event.state is StepState.STARTED:
            # Long enough for debootstrap to be unpacking and running maintainer scripts in its chroot.
            t = threading.Timer(12.0, _thread.interrupt_main)
            t.start()
            timer.append(t)

    try:
        with pytest.raises(KeyboardInterrupt):
            ensure_image(settings, progress=interrupt_during_debootstrap)
    finally:
        for t in timer:
            t.cancel()
    assert timer, "the build never reached debootstrap"
    assert _processes_mentioning(str(seeded_cache)) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(seeded_cache) not in mounts
    state = _cache_state(seeded_cache)
    assert state == {"images": [], "base": [], "tmp": []}


def test_cli_build_then_show_agree(guest_image: GuestImage) -> None:
    # Other work may edit the guest sources meanwhile, so the CLI may build a newer image than the
    # session fixture's; what must hold is that `build` and `show` describe the same, complete image.
    proc = subprocess.run([CAPSA, "image", "build", "--json"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    image_dir = Settings().cache_dir / "images" / manifest["digest"]
    for name, art in manifest["artifacts"].items():
        assert (image_dir / name).stat().st_size == art["size"]
    show = subprocess.run([CAPSA, "image", "show", "--json"], capture_output=True, text=True, check=False)
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["digest"] == manifest["digest"]


def test_cli_show_without_image_fails_clearly(tmp_path: Path) -> None:
    proc = subprocess.run([CAPSA, "image", "show", "--cache-dir",
                           str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "capsa image build" in proc.stderr
    assert proc.stdout == ""

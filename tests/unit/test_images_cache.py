"""Cache keying, lookup, locking and atomic publication (no network, no debootstrap)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from capsa.common.settings import Settings
from capsa.images import build
from capsa.images.build import ImageConfig, config_inputs, find_image
from capsa.images.cache import CacheLayout, digest_json


def _config(tmp_path: Path) -> ImageConfig:
    return ImageConfig.from_settings(Settings(cache_dir=tmp_path))


def test_config_digest_is_stable(tmp_path: Path) -> None:
    c = _config(tmp_path)
    assert digest_json(config_inputs(c)) == digest_json(config_inputs(c))


def test_config_digest_covers_guest_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = _config(tmp_path)
    before = digest_json(config_inputs(c))
    real = build.guest_sources()
    assert "__init__.py" in real
    monkeypatch.setattr(build, "guest_sources", lambda: {**real, "daemon.py": b"# changed\n"})
    after = config_inputs(c)
    assert digest_json(after) != before
    assert after["sources"]["guest/daemon.py"] == hashlib.sha256(b"# changed\n").hexdigest()


@pytest.mark.parametrize("change", [
    {"packages": ("python3", "ca-certificates", "iproute2", "curl")},
    {"modules": ("virtio_ring", "virtio")},
    {"suite": "trixie"},
    {"mirror": "http://mirror.example/debian"},
    {"rootfs_size_mib": 4096},
    {"kernel_package": "linux-image-amd64"},
])
def test_config_digest_covers_every_setting(tmp_path: Path, change: dict[str, Any]) -> None:
    c = _config(tmp_path)
    assert digest_json(config_inputs(replace(c, **change))) != digest_json(config_inputs(c))


def test_cache_dir_is_not_an_input(tmp_path: Path) -> None:
    a = config_inputs(_config(tmp_path / "a"))
    b = config_inputs(_config(tmp_path / "b"))
    assert a == b


def _fake_image(cache: Path, key: str, config_digest: str, built_at: str, sizes: int = 10) -> Path:
    d = CacheLayout(cache).image_dir(key)
    d.mkdir(parents=True)
    artifacts = {}
    for name in (build.KERNEL_FILE, build.INITRD_FILE, build.ROOTFS_FILE):
        (d / name).write_bytes(b"x" * sizes)
        artifacts[name] = {"size": sizes, "sha256": "0" * 64, "allocated": 4096}
    manifest = {"digest": key, "config_digest": config_digest, "built_at": built_at,
                "kernel": {"release": "6.1.0-test"}, "artifacts": artifacts}
    (d / build.MANIFEST_FILE).write_text(json.dumps(manifest))
    return d


def test_find_image_matches_current_inputs_only(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    assert find_image(settings) is None
    current = digest_json(config_inputs(_config(tmp_path)))
    _fake_image(tmp_path, "other", "f" * 64, "2026-01-02T00:00:00+00:00")
    assert find_image(settings) is None
    _fake_image(tmp_path, "old", current, "2026-01-01T00:00:00+00:00")
    newest = _fake_image(tmp_path, "new", current, "2026-01-03T00:00:00+00:00")
    img = find_image(settings)
    assert img is not None
    assert img.digest == "new"
    assert img.kernel == newest / "vmlinux"
    assert img.kernel_release == "6.1.0-test"
    assert img.manifest == newest / "manifest.json"


def test_find_image_ignores_damaged_images(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    current = digest_json(config_inputs(_config(tmp_path)))
    truncated = _fake_image(tmp_path, "truncated", current, "2026-01-01T00:00:00+00:00")
    (truncated / build.ROOTFS_FILE).write_bytes(b"x")
    missing = _fake_image(tmp_path, "missing", current, "2026-01-02T00:00:00+00:00")
    (missing / build.KERNEL_FILE).unlink()
    garbage = _fake_image(tmp_path, "garbage", current, "2026-01-03T00:00:00+00:00")
    (garbage / build.MANIFEST_FILE).write_text("{not json")
    assert find_image(settings) is None


def test_build_lock_sweeps_debris_of_dead_builds(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    debris = layout.tmp / "build-dead" / "image"
    debris.mkdir(parents=True)
    (debris / "rootfs.ext4").write_bytes(b"half")
    (layout.tmp / "stray-file").write_bytes(b"")
    with layout.build_lock():
        assert list(layout.tmp.iterdir()) == []


def test_build_lock_serializes_builders(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    events: list[str] = []

    def hold(tag: str) -> None:
        with layout.build_lock():
            events.append(f"{tag}-in")
            time.sleep(0.2)
            events.append(f"{tag}-out")

    threads = [threading.Thread(target=hold, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events in (["a-in", "a-out", "b-in", "b-out"], ["b-in", "b-out", "a-in", "a-out"])


def test_workdir_is_removed_even_when_interrupted(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    seen: list[Path] = []
    with pytest.raises(KeyboardInterrupt), layout.workdir("build-") as work:
        seen.append(work)
        (work / "partial").write_bytes(b"half")
        raise KeyboardInterrupt
    assert not seen[0].exists()


def test_publish_replaces_atomically(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    layout.tmp.mkdir(parents=True)
    dest = layout.image_dir("k")
    for content in (b"one", b"two"):
        staged = layout.tmp / f"staged-{content.decode()}"
        staged.mkdir()
        (staged / "f").write_bytes(content)
        layout.publish(staged, dest)
        assert (dest / "f").read_bytes() == content
        assert not staged.exists()
    assert list(layout.tmp.iterdir()) == []


def test_discard_removes_a_published_entry(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    d = _fake_image(tmp_path, "gone", "0" * 64, "2026-01-01T00:00:00+00:00")
    layout.discard(d)
    assert not d.exists()
    assert list(layout.tmp.iterdir()) == []


def test_unusable_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    from capsa.images import ImageBuildError, ensure_image

    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"keep me")
    with pytest.raises(ImageBuildError, match=r"image build failed: .*cache: .*file"):
        ensure_image(Settings(cache_dir=not_a_dir))
    assert not_a_dir.read_bytes() == b"keep me"


def test_prune_keeps_the_newest_and_the_recent(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    ages_hours = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 48, "g": 72, "h": 96}
    for key, hours in ages_hours.items():
        _fake_image(tmp_path, key, "0" * 64, (now - timedelta(hours=hours)).isoformat(timespec="seconds"))
    builder = build._Builder(_config(tmp_path), None)
    builder._prune(keep=CacheLayout(tmp_path).image_dir("a"))
    left = sorted(p.name for p in CacheLayout(tmp_path).images.iterdir())
    # The newest four stay; so does "e" (beyond four but recent); day-old extras go.
    assert left == ["a", "b", "c", "d", "e"]
    assert list(CacheLayout(tmp_path).tmp.iterdir()) == []

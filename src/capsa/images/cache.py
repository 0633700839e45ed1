"""The on-disk layout of the image cache and the locking that makes builds safe to run concurrently.

```
<cache_dir>/
  apt/<mirror+suite digest>/     private apt lists (see capsa.images.apt)
  debs/                          downloaded kernel and busybox packages
  debootstrap-debs/              debootstrap's package cache
  base/<base key>.tar.zst        debootstrap results (+ .json describing the inputs)
  images/<image key>/            finished images: vmlinux, initrd.cpio.gz, rootfs.ext4, manifest.json
  tmp/                           work directories of builds in progress
  build.lock                     held (flock) by the one process building
```

An image directory only ever appears by ``rename`` of a finished work directory, so a build that
dies midway leaves at most a work directory under tmp/, which the next build sweeps.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CacheLayout", "digest_json"]


def digest_json(value: Any) -> str:
    """sha256 of a canonical JSON encoding of ``value``."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class CacheLayout:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def debs(self) -> Path:
        return self.root / "debs"

    @property
    def debootstrap_debs(self) -> Path:
        return self.root / "debootstrap-debs"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def apt(self, mirror: str, suite: str) -> Path:
        return self.root / "apt" / digest_json({"mirror": mirror, "suite": suite})[:16]

    def image_dir(self, key: str) -> Path:
        return self.images / key

    def base_tarball(self, key: str) -> Path:
        return self.base / f"{key}.tar.zst"

    @contextlib.contextmanager
    def build_lock(self) -> Iterator[None]:
        """Hold the cache's build lock (blocking); on entry, sweep work dirs of dead builds."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Whoever held the lock before us has finished or died, so anything left in tmp/ is
            # debris from an interrupted build.
            if self.tmp.exists():
                for entry in self.tmp.iterdir():
                    _remove(entry)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def workdir(self, prefix: str) -> Iterator[Path]:
        """A fresh directory under tmp/ that is deleted on exit, whatever happened."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp))
        try:
            yield path
        finally:
            _remove(path)

    def publish(self, built: Path, dest: Path) -> None:
        """Atomically move a finished directory or file into place, replacing an older one."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            old = self.tmp / f"old-{dest.name}-{os.getpid()}"
            dest.rename(old)
            built.rename(dest)
            _remove(old)
        else:
            built.rename(dest)


    def discard(self, path: Path) -> None:
        """Remove a published entry: it disappears at once (rename), then is deleted."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        doomed = self.tmp / f"discard-{path.name}-{os.getpid()}"
        path.rename(doomed)
        _remove(doomed)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _assert_no_mounts(path)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _assert_no_mounts(path: Path) -> None:
    # debootstrap runs in its own mount namespace, so nothing should ever be mounted here; if
    # something is, deleting through it could destroy host data, so refuse loudly instead.
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4]
            if mount_point.startswith(prefix):
                raise RuntimeError(f"refusing to delete {path}: {mount_point} is mounted inside it")

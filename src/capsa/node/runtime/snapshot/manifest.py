"""The on-disk description of a VM snapshot: ``manifest.json`` and the digests that make it checkable.

A snapshot directory holds::

    manifest.json   this model
    state.bin       QEMU's migration stream: device state, plus guest RAM when the VM's memory was private
    memory.ram      guest RAM as a flat file (absent when the RAM is inside state.bin)
    disk.img        the root disk at the instant the VM was stopped

The manifest's ``digest`` covers every field, including each file's size and (where computed) content
hash, so two snapshots with the same digest describe the same thing and a tampered manifest is noticed.
Hashing a 2 GiB disk on every rolling snapshot would cost seconds, so content hashes of the big files are
optional (``content_digest=True`` when saving templates); the device state is always hashed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capsa.node.runtime.base import RuntimeError_

__all__ = [
    "DISK_FILE",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "RAM_FILE",
    "STATE_FILE",
    "FileEntry",
    "Snapshot",
    "SnapshotError",
    "SnapshotManifest",
    "file_sha256",
    "load_manifest",
    "write_manifest",
]

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.bin"
RAM_FILE = "memory.ram"
DISK_FILE = "disk.img"
_CHUNK = 4 * 1024 * 1024


class SnapshotError(RuntimeError_):
    code = "snapshot_error"
    status = 500


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a plain name inside the snapshot dir
    size: int = Field(ge=0)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class SnapshotManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: int = FORMAT_VERSION
    id: str
    created_at: datetime
    memory_mib: int = Field(ge=16)
    vcpus: int = Field(ge=1)
    accel: str
    image_digest: str
    qemu_version: str | None = None
    machine: str | None = None
    """Fingerprint of the QEMU device layout the state was saved from; a restore must use the same one."""
    device_state: FileEntry
    ram: FileEntry | None  # None: the RAM pages are inside device_state
    disk: FileEntry
    parent: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    digest: str = ""

    def compute_digest(self) -> str:
        body = self.model_dump(mode="json", exclude={"digest"})
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(canonical).hexdigest()

    def sealed(self) -> SnapshotManifest:
        return self.model_copy(update={"digest": self.compute_digest()})

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC).replace(microsecond=0)


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes, reading only its data regions (holes hash as the zeros they are)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    zeros = bytes(_CHUNK)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        while pos < size:
            try:
                data_start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                data_start = size
            # Hash the hole without reading it.
            while pos < data_start:
                n = min(_CHUNK, data_start - pos)
                h.update(zeros[:n])
                pos += n
            if pos >= size:
                break
            data_end = os.lseek(fd, pos, os.SEEK_HOLE)
            while pos < data_end:
                chunk = os.pread(fd, min(_CHUNK, data_end - pos), pos)
                if not chunk:
                    raise SnapshotError(f"{path} shrank while being hashed")
                h.update(chunk)
                pos += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def write_manifest(directory: Path, manifest: SnapshotManifest) -> SnapshotManifest:
    sealed = manifest.sealed()
    tmp = directory / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(sealed.model_dump_json(indent=2))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST_FILE)
    return sealed


def load_manifest(directory: Path, *, verify_content: bool = False) -> SnapshotManifest:
    """Read and check a snapshot directory: manifest digest, files present with the recorded sizes.

    The device state (tens of KB) is always re-hashed: QEMU exits on a bad stream with an unhelpful
    message. ``verify_content`` also re-hashes the other files that have a recorded hash.
    """
    path = directory / MANIFEST_FILE
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SnapshotError(f"{directory} is not a snapshot (no {MANIFEST_FILE})",
                            code="snapshot_not_found", status=404) from None
    try:
        manifest = SnapshotManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise SnapshotError(f"invalid snapshot manifest {path}: {exc.errors()[0]['msg']}",
                            code="snapshot_corrupt") from None
    if manifest.format != FORMAT_VERSION:
        raise SnapshotError(f"snapshot {directory} has format {manifest.format}, "
                            f"this node reads {FORMAT_VERSION}", code="snapshot_corrupt")
    if manifest.digest != manifest.compute_digest():
        raise SnapshotError(f"snapshot manifest {path} does not match its digest", code="snapshot_corrupt")
    entries = [manifest.device_state, manifest.disk] + ([manifest.ram] if manifest.ram else [])
    for entry in entries:
        fp = directory / entry.path
        try:
            size = fp.stat().st_size
        except FileNotFoundError:
            raise SnapshotError(f"snapshot {directory} is missing {entry.path}",
                                code="snapshot_corrupt") from None
        if size != entry.size:
            raise SnapshotError(f"snapshot file {fp} has {size} bytes, manifest says {entry.size}",
                                code="snapshot_corrupt")
        check = verify_content or entry is manifest.device_state
        if check and entry.sha256 is not None and file_sha256(fp) != entry.sha256:
            raise SnapshotError(f"snapshot file {fp} does not match its recorded sha256",
                                code="snapshot_corrupt")
    return manifest


@dataclass(frozen=True)
class Snapshot:
    """A snapshot directory and its (verified) manifest."""

    path: Path
    manifest: SnapshotManifest

    @property
    def id(self) -> str:
        return self.manifest.id

    @classmethod
    def open(cls, path: Path, *, verify_content: bool = False) -> Snapshot:
        return cls(path, load_manifest(path, verify_content=verify_content))

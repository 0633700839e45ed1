"""Files as content-addressed chunks: what makes shipping a snapshot cost what changed, not its size.

A file is cut into fixed chunks (1 MiB by default; the size is recorded per file). A chunk of zeros is
recorded as ``None`` and never stored (sparse disks and untouched RAM). Any other chunk is stored once under
``chunks/<scope>/<aa>/<sha256>``, zstd-compressed, where the digest is that of the plain chunk: a chunk
already in the store (of the template the snapshot came from, of the session's previous snapshot) is
referenced, not uploaded again, so a rolling snapshot ships the pages and blocks that changed.

Scopes keep tenants apart: a snapshot's new chunks go to its tenant's scope and it may reference only chunks
of its own scope or of a shared one (templates); no tenant can learn by timing an upload whether another
tenant's data contains a chunk. Reading a chunk checks its digest: a damaged or swapped object is refused.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zstandard
from pydantic import BaseModel, ConfigDict, Field

from capsa.store.objects import ObjectStore, StoreError, check_key

__all__ = ["CHUNK_SIZE", "ChunkRef", "FileRecord", "TransferStats", "chunk_key", "pull_file", "push_file"]

CHUNK_SIZE = 1024 * 1024
_THREADS = 8
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/[0-9a-f]{64}$")

ChunkRef = str
"""``<scope>/<sha256 of the plain chunk>``."""


class FileRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    chunk_size: int = Field(ge=4096, le=64 * 1024 * 1024)
    chunks: list[ChunkRef | None]
    """One per chunk, in order; None: the chunk is all zeros."""

    def refs(self) -> set[ChunkRef]:
        return {c for c in self.chunks if c is not None}


class TransferStats(BaseModel):
    chunks: int = 0
    zero_chunks: int = 0
    reused_chunks: int = 0
    sent_chunks: int = 0
    sent_bytes: int = 0
    """Pushing: compressed bytes written to the store; pulling: bytes of chunks written to the file."""

    def add(self, other: TransferStats) -> None:
        for name in type(self).model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def chunk_key(ref: ChunkRef) -> str:
    if not _REF.match(ref):
        raise StoreError(f"not a chunk reference: {ref!r}")
    scope, digest = ref.split("/")
    return check_key(f"chunks/{scope}/{digest[:2]}/{digest}")


def push_file(store: ObjectStore, path: Path, scope: str, *, known: set[ChunkRef],
              reusable: Iterable[ChunkRef] = (), chunk_size: int = CHUNK_SIZE
              ) -> tuple[FileRecord, TransferStats]:
    """Store ``path`` as chunks of ``scope``. ``known``: chunk refs known to be in the store (updated with
    what this call stores); ``reusable``: refs of other scopes this file may point at (its template's)."""
    by_digest = {r.split("/", 1)[1]: r for r in reusable}
    stats = TransferStats()
    zero = bytes(chunk_size)
    size = path.stat().st_size
    refs: list[ChunkRef | None] = []
    pending: dict[ChunkRef, int] = {}  # ref -> offset of one chunk with that content

    with path.open("rb") as f:
        offset = 0
        while offset < size:
            data = os.pread(f.fileno(), chunk_size, offset)
            stats.chunks += 1
            if data == zero[:len(data)]:
                refs.append(None)
                stats.zero_chunks += 1
            else:
                digest = hashlib.sha256(data).hexdigest()
                ref = by_digest.get(digest) or f"{scope}/{digest}"
                refs.append(ref)
                if ref in known or ref in pending:
                    stats.reused_chunks += 1
                else:
                    pending[ref] = offset
            offset += chunk_size

        def send(item: tuple[ChunkRef, int]) -> int:
            ref, at = item
            key = chunk_key(ref)
            if store.exists(key):  # an earlier push that stopped half way, or another node's
                return 0
            blob = zstandard.ZstdCompressor(level=1).compress(os.pread(f.fileno(), chunk_size, at))
            store.put(key, blob)
            return len(blob)

        with ThreadPoolExecutor(_THREADS) as pool:
            for ref, sent in zip(pending, pool.map(send, pending.items()), strict=True):
                known.add(ref)
                if sent:
                    stats.sent_chunks += 1
                    stats.sent_bytes += sent
                else:
                    stats.reused_chunks += 1
    return FileRecord(size=size, chunk_size=chunk_size, chunks=refs), stats


def _fetch(store: ObjectStore, ref: ChunkRef, chunk_size: int) -> bytes:
    blob = store.get(chunk_key(ref))
    try:
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=chunk_size)
    except zstandard.ZstdError as e:
        raise StoreError(f"chunk {ref} in {store.url} is damaged: {e}") from e
    if hashlib.sha256(data).hexdigest() != ref.split("/", 1)[1]:
        raise StoreError(f"chunk {ref} in {store.url} does not match its digest")
    return data


def pull_file(store: ObjectStore, record: FileRecord, dest: Path) -> TransferStats:
    """Write the file ``record`` describes to ``dest`` (sparse where its chunks are zeros); every chunk's
    digest is checked. ``dest`` is written in place: callers write into a directory they rename when done."""
    stats = TransferStats(chunks=len(record.chunks))
    want = [(i, ref) for i, ref in enumerate(record.chunks) if ref is not None]
    stats.zero_chunks = len(record.chunks) - len(want)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, record.size)

        def fetch(item: tuple[int, ChunkRef]) -> int:
            i, ref = item
            data = _fetch(store, ref, record.chunk_size)
            end = min(record.size, (i + 1) * record.chunk_size)
            if len(data) != end - i * record.chunk_size:
                raise StoreError(f"chunk {ref} in {store.url} has the wrong length")
            os.pwrite(fd, data, i * record.chunk_size)
            return len(data)

        with ThreadPoolExecutor(_THREADS) as pool:
            for n in pool.map(fetch, want):
                stats.sent_chunks += 1
                stats.sent_bytes += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return stats

"""A directory of files (a snapshot, a template) in the store: its files as chunks plus one index object.

``bundles/<kind>/<name>.json`` is the index (:class:`Bundle`): each file's
:class:`~capsa.store.chunks.FileRecord`, the scope its new chunks went to and free-form ``meta``. The index
is written after every chunk it names, so an index that can be read names chunks that are there (the
collector, :mod:`capsa.store.collect`, keeps chunks younger than a grace period for pushes in flight).
Pulling writes into a temporary directory beside the destination and renames it into place: the
destination is whole or absent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capsa.store.chunks import ChunkRef, FileRecord, TransferStats, pull_file, push_file
from capsa.store.objects import ObjectStore, StoreError, check_key

__all__ = ["Bundle", "bundle_key", "delete_bundle", "list_bundles", "pull_bundle", "push_bundle",
           "read_bundle"]

FORMAT = 1


class Bundle(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: int = FORMAT
    kind: str = Field(pattern=r"^[a-z]{1,32}$")
    name: str
    scope: str
    created_at: float
    files: dict[str, FileRecord]
    meta: dict[str, Any] = {}

    def refs(self) -> set[ChunkRef]:
        return set().union(*(f.refs() for f in self.files.values())) if self.files else set()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


def bundle_key(kind: str, name: str) -> str:
    return check_key(f"bundles/{kind}/{name}.json")


def push_bundle(store: ObjectStore, kind: str, name: str, directory: Path, files: Iterable[str], *,
                scope: str, known: set[ChunkRef], reusable: Iterable[ChunkRef] = (),
                meta: Mapping[str, Any] | None = None) -> tuple[Bundle, TransferStats]:
    key = bundle_key(kind, name)
    reuse = list(reusable)
    stats = TransferStats()
    records: dict[str, FileRecord] = {}
    for fname in files:
        check_key(fname)
        record, s = push_file(store, directory / fname, scope, known=known, reusable=reuse)
        records[fname] = record
        stats.add(s)
    bundle = Bundle(kind=kind, name=name, scope=scope, created_at=time.time(), files=records,
                    meta=dict(meta or {}))
    blob = bundle.model_dump_json().encode()
    store.put(key, blob)
    stats.sent_bytes += len(blob)
    return bundle, stats


def read_bundle(store: ObjectStore, kind: str, name: str) -> Bundle:
    raw = store.get(bundle_key(kind, name))
    try:
        bundle = Bundle.model_validate_json(raw)
    except ValidationError as e:
        why = e.errors()[0]["msg"]
        raise StoreError(f"{bundle_key(kind, name)} in {store.url} is not a bundle index: {why}") from e
    if bundle.kind != kind or bundle.name != name or bundle.format != FORMAT:
        raise StoreError(f"{bundle_key(kind, name)} in {store.url} describes another bundle")
    return bundle


def list_bundles(store: ObjectStore, kind: str) -> list[str]:
    prefix = f"bundles/{kind}/"
    return [o.key[len(prefix):-5] for o in store.list(prefix) if o.key.endswith(".json")]


def delete_bundle(store: ObjectStore, kind: str, name: str) -> None:
    """Forget the bundle; its chunks go when the collector finds no bundle naming them."""
    store.delete(bundle_key(kind, name))


def pull_bundle(store: ObjectStore, kind: str, name: str, dest: Path) -> tuple[Bundle, TransferStats]:
    """Materialise the bundle as directory ``dest`` (which must not exist)."""
    bundle = read_bundle(store, kind, name)
    if dest.exists():
        raise StoreError(f"{dest} exists already")
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    stats = TransferStats()
    try:
        for fname, record in bundle.files.items():
            check_key(fname)
            (work / fname).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            stats.add(pull_file(store, record, work / fname))
        os.rename(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return bundle, stats

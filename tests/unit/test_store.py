"""The fleet's store: both backends (a real S3 server and a directory) behind one interface, and the chunked
layout of snapshots on it (dedupe, sparse files, digests checked, tenants' chunks apart, collection)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsa.control.settings import ControlSettings
from capsa.control.store_collect import collect_unused, collection_due
from capsa.store import ObjectMissing, ObjectStore, StoreError, open_store
from capsa.store.bundles import delete_bundle, list_bundles, pull_bundle, push_bundle, read_bundle
from capsa.store.chunks import CHUNK_SIZE, chunk_key, pull_file, push_file
from capsa.store.collect import collect_chunks
from capsa.store.s3 import S3Store
from tests.support.s3_server import S3Server

MiB = 1024 * 1024


@pytest.fixture(params=["directory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[ObjectStore]:
    if request.param == "directory":
        yield open_store((tmp_path / "store").as_uri())
        return
    server: S3Server = request.getfixturevalue("s3_server")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    bucket = "t" + secrets.token_hex(6)
    server.make_bucket(bucket)
    yield open_store(f"s3://{bucket}/fleet", s3_endpoint=server.endpoint)


def test_objects_round_trip_and_list(store: ObjectStore, tmp_path: Path) -> None:
    store.put("a/b/one", b"1")
    store.put("a/two", b"22")
    store.put("c", b"333")
    assert store.get("a/b/one") == b"1" and store.exists("a/two") and not store.exists("a/nope")
    assert [(o.key, o.size) for o in store.list("a/")] == [("a/b/one", 1), ("a/two", 2)]
    assert {o.key for o in store.list("")} == {"a/b/one", "a/two", "c"}
    store.put("c", b"new")
    assert store.get("c") == b"new"
    store.delete("c")
    store.delete("c")  # gone already: no error
    with pytest.raises(ObjectMissing):
        store.get("c")
    with pytest.raises(ObjectMissing):
        store.get_file("c", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_check_says_a_store_is_usable_and_changes_nothing(store: ObjectStore) -> None:
    store.put("kept", b"1")
    found = store.check()
    assert found.endswith("is writable") or found.endswith("answered HEAD")
    assert [o.key for o in store.list("")] == ["kept"]


def test_check_says_why_a_store_cannot_be_used(tmp_path: Path, s3_server: S3Server,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gone = open_store((tmp_path / "gone").as_uri())
    (tmp_path / "gone").rmdir()
    with pytest.raises(StoreError, match=f"store directory {tmp_path / 'gone'} is not writable"):
        gone.check()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    missing = "t" + secrets.token_hex(6)
    with pytest.raises(StoreError, match=f"bucket {missing} at .*: HEAD answered 404"):
        open_store(f"s3://{missing}/fleet", s3_endpoint=s3_server.endpoint).check()


def test_a_large_file_goes_in_parts_and_comes_back_whole(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.write_bytes(os.urandom(40 * MiB))  # above the 16 MiB multipart threshold of the S3 backend
    store.put_file("big", src)
    store.get_file("big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    if isinstance(store, S3Store):  # an S3 object uploaded in n parts has an ETag ending in "-n"
        etag = store._client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/big")["ETag"]
        assert etag.strip('"').endswith("-3")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/abs", "a//b", ".hidden", "a/.tmp-x", "", "a/b/"])
def test_keys_that_could_escape_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(StoreError, match="not a store key"):
        store.put(key, b"x")


def _file(path: Path, chunks: list[bytes | None]) -> Path:
    """A file of whole chunks: bytes fill a chunk (repeated), None leaves a hole."""
    with path.open("wb") as f:
        for c in chunks:
            if c is None:
                f.seek(CHUNK_SIZE, os.SEEK_CUR)
            else:
                f.write((c * (CHUNK_SIZE // len(c) + 1))[:CHUNK_SIZE])
        f.truncate()
    return path


def test_chunks_skip_zeros_and_reuse_what_the_store_has(store: ObjectStore, tmp_path: Path) -> None:
    src = _file(tmp_path / "disk", [b"a", None, b"b", b"a", None, b"c"])
    with src.open("ab") as f:
        f.write(b"tail")  # a last chunk shorter than the others
    known: set[str] = set()
    record, stats = push_file(store, src, "ten_a", known=known)
    assert (stats.chunks, stats.zero_chunks, stats.sent_chunks, stats.reused_chunks) == (7, 2, 4, 1)
    back = tmp_path / "back"
    pull_file(store, record, back)
    assert back.read_bytes() == src.read_bytes()
    assert back.stat().st_blocks * 512 < back.stat().st_size  # holes stay holes

    # One chunk changed: one chunk is sent, even by a process that knows nothing of the store (HEAD finds
    # the others).
    with src.open("r+b") as f:
        f.seek(2 * CHUNK_SIZE)
        f.write(b"B" * 10)
    _, again = push_file(store, src, "ten_a", known=set())
    assert again.sent_chunks == 1 and again.reused_chunks == 4


def test_a_damaged_or_swapped_chunk_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    src = _file(tmp_path / "f", [b"x", b"y"])
    record, _ = push_file(store, src, "ten_a", known=set())
    first, second = record.chunks
    assert first and second
    store.put(chunk_key(first), store.get(chunk_key(second)))  # a valid chunk under the wrong name
    with pytest.raises(StoreError, match="does not match its digest"):
        pull_file(store, record, tmp_path / "back")
    store.put(chunk_key(first), b"not zstd")
    with pytest.raises(StoreError, match="damaged"):
        pull_file(store, record, tmp_path / "back")


def test_tenants_chunks_stay_in_their_scope_but_may_point_at_a_template(store: ObjectStore,
                                                                        tmp_path: Path) -> None:
    tpl = _file(tmp_path / "tpl", [b"t", b"u"])
    tpl_record, _ = push_file(store, tpl, "templates", known=set())
    mine = _file(tmp_path / "mine", [b"t", b"u", b"secret of a"])
    rec_a, stats_a = push_file(store, mine, "ten_a", known=set(), reusable=tpl_record.refs())
    assert stats_a.sent_chunks == 1 and {r.split("/")[0] for r in rec_a.refs()} == {"templates", "ten_a"}
    # Tenant b writes the same bytes: they are stored again, in b's scope (no cross-tenant dedupe oracle).
    rec_b, stats_b = push_file(store, mine, "ten_b", known=set(), reusable=tpl_record.refs())
    assert stats_b.sent_chunks == 1
    assert rec_a.refs() - tpl_record.refs() != rec_b.refs() - tpl_record.refs()


def test_bundles_are_whole_or_absent_and_collection_keeps_what_they_name(store: ObjectStore,
                                                                         tmp_path: Path) -> None:
    d = tmp_path / "snap"
    d.mkdir()
    (d / "manifest.json").write_text('{"id": "snap_x"}')
    _file(d / "memory.ram", [b"m", None, b"n"])
    bundle, _ = push_bundle(store, "snapshot", "snap_x", d, ["manifest.json", "memory.ram"], scope="ten_a",
                            known=set(), meta={"tenant": "ten_a"})
    assert list_bundles(store, "snapshot") == ["snap_x"]
    assert read_bundle(store, "snapshot", "snap_x") == bundle
    out = tmp_path / "pulled"
    pull_bundle(store, "snapshot", "snap_x", out)
    assert (out / "memory.ram").read_bytes() == (d / "memory.ram").read_bytes()
    with pytest.raises(StoreError, match="exists already"):
        pull_bundle(store, "snapshot", "snap_x", out)

    # A pull that fails half way leaves no directory behind.
    ref = next(iter(bundle.files["memory.ram"].refs()))
    store.delete(chunk_key(ref))
    with pytest.raises(ObjectMissing):
        pull_bundle(store, "snapshot", "snap_x", tmp_path / "half")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["pulled", "snap"]

    # Collection: a chunk no bundle names goes once it is older than the grace period; named ones stay.
    push_bundle(store, "snapshot", "snap_x", d, ["manifest.json", "memory.ram"], scope="ten_a", known=set())
    _file(tmp_path / "orphan", [b"o"])
    orphan, _ = push_file(store, tmp_path / "orphan", "ten_a", known=set())
    young = collect_chunks(store, grace_s=3600)
    assert young.deleted == 0 and young.bundles == 1
    old = collect_chunks(store, grace_s=-60)
    assert old.deleted == 1 and not store.exists(chunk_key(next(iter(orphan.refs()))))
    pull_bundle(store, "snapshot", "snap_x", tmp_path / "again")
    delete_bundle(store, "snapshot", "snap_x")
    assert collect_chunks(store, grace_s=-60).deleted == 3 and store.list("chunks/") == []


def test_store_urls() -> None:
    for bad in ["ftp://x", "file://host/x", "file:relative", "s3://", "s3://b/p?x=1", "/plain/path"]:
        with pytest.raises(StoreError, match="CAPSA_STORE_URL"):
            open_store(bad)
    # An empty CAPSA_STORE_S3_ENDPOINT (a manifest's unset value) means AWS's own endpoint, as absent does.
    assert open_store("s3://bucket/p", s3_endpoint="").url == open_store("s3://bucket/p").url == "s3://bucket/p"


async def test_the_control_plane_collects_the_stores_unused_chunks_when_due(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    (tmp_path / "f").write_bytes(b"x" * 10)
    push_file(store, tmp_path / "f", "ten_a", known=set())
    settings = ControlSettings(store_url=store.url, store_collect_interval=60)
    assert collection_due(settings, 0.0, 5.0) and not collection_due(settings, 100.0, 130.0)
    assert collection_due(settings, 100.0, 161.0) and not collection_due(ControlSettings(), 0.0, 5.0)
    young = await collect_unused(settings)
    assert young is not None and young.chunks == 1 and young.deleted == 0  # within the grace period
    old = await collect_unused(settings.model_copy(update={"store_collect_grace": 0.0}))
    assert old is not None and old.deleted == 1 and store.list("chunks/") == []

"""A node's snapshots in the fleet's store (node/agent/shipping.py), on the directory backend: a snapshot's
chunks that equal a template's are referenced in the shared templates scope, its own go to its tenant's,
and another node pulls it back whole."""

from __future__ import annotations

import os
from pathlib import Path

from capsa.node.agent.shipping import Shipper
from capsa.node.runtime.snapshot.manifest import DISK_FILE, RAM_FILE, Snapshot, SnapshotManifest
from capsa.store import open_store
from capsa.store.bundles import push_bundle, read_bundle
from capsa.store.chunks import CHUNK_SIZE


def _write(path: Path, chunks: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((c * (CHUNK_SIZE // len(c) + 1))[:CHUNK_SIZE] for c in chunks))


async def test_a_snapshot_reuses_its_templates_chunks_and_comes_back_whole(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    template = tmp_path / "tpl" / "snap_template"
    _write(template / RAM_FILE, [b"kernel", b"libc", b"idle"])
    _write(template / DISK_FILE, [b"rootfs", b"usr"])
    push_bundle(store, "template", "base-r3-x-m256c1-y", template.parent, [f"snap_template/{RAM_FILE}",
                                                                             f"snap_template/{DISK_FILE}"],
                scope="templates", known=set())

    snap_dir = tmp_path / "node-a" / "snap_abc"
    _write(snap_dir / RAM_FILE, [b"kernel", b"libc", b"my-work"])  # one page group changed
    _write(snap_dir / DISK_FILE, [b"rootfs", b"my-file"])
    manifest = SnapshotManifest.model_construct(id="snap_abc", labels={"capsa.tenant": "ten_a"})
    stats = await Shipper(store, snap_dir.parent).push(Snapshot(snap_dir, manifest))
    assert (stats.chunks, stats.sent_chunks, stats.reused_chunks) == (5, 2, 3)
    refs = read_bundle(store, "snapshot", "snap_abc").refs()
    assert {r.split("/")[0] for r in refs} == {"templates", "ten_a"}
    assert len([r for r in refs if r.startswith("ten_a/")]) == 2

    node_b = tmp_path / "node-b"
    node_b.mkdir()
    assert await Shipper(store, node_b).pull("snap_abc")
    for name in (RAM_FILE, DISK_FILE):
        assert (node_b / "snap_abc" / name).read_bytes() == (snap_dir / name).read_bytes()
    assert oct(os.stat(node_b / "snap_abc").st_mode & 0o777) == "0o700"
    assert not await Shipper(store, node_b).pull("snap_" + "z" * 20)  # the store has none: False

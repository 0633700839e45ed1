"""The fleet's store: what shipping a snapshot costs, first and again, and what importing a template costs.

In this process, on the production node assembly (``build_node``: QEMU runtime on a btrfs pool in a
temporary state dir, template cache of this host), for ``base`` (256 MiB) and ``browser`` (1 GiB) sandboxes
left idle:

1. snapshot 1 of the sandbox, pushed to the store (chunks, zstd, dedupe): seconds, chunks and bytes sent;
2. ``--idle`` seconds later snapshot 2, pushed again: what a rolling snapshot of an idle session ships;
3. the naive path for comparison: every file of snapshot 1 compressed whole (zstd level 1), i.e. what an
   upload of whole files would send each time; ratio naive / chunked for the first and the second push;
0. first, the template each sandbox comes from pushed to the store (``TemplateCache.share``) and pulled into
   an empty cache (``TemplateCache.fetch``, what a node that never built it does on first use); a snapshot's
   chunks equal to its template's are then referenced, not sent;

Both backends in one run: a directory and a real S3 server (OpenStack Swift with s3api, started here as the
tests start it) unless ``--no-s3``. Writes ``bench/results/fleet_store.json``; removes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: the S3 server

from tests.support.s3_server import temporary_s3

from capsa.common.egress_policy import EgressPolicy
from capsa.common.ids import new_id
from capsa.common.settings import Settings
from capsa.images import ensure_image
from capsa.node.agent.shipping import Shipper
from capsa.node.assembly import build_node
from capsa.node.runtime.snapshot.manifest import Snapshot
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.shipped import shipped_template
from capsa.store import ObjectStore, open_store
from harness import host_facts, write_results

RESULTS = Path(__file__).with_name("results") / "fleet_store.json"
SIZES = {"base": 256, "browser": 1024}


def _naive(snap: Snapshot) -> dict[str, float]:
    """Every file of the snapshot compressed whole: bytes and seconds."""
    started, total = time.perf_counter(), 0
    for path in sorted(snap.path.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            compressor = zstandard.ZstdCompressor(level=1)
            with path.open("rb") as f:
                for chunk in compressor.read_to_iter(f, read_size=4 << 20):
                    total += len(chunk)
    return {"bytes": total, "seconds": time.perf_counter() - started}


async def _push(shipper: Shipper, snap: Snapshot) -> dict[str, Any]:
    started = time.perf_counter()
    stats = await shipper.push(snap)
    return {"seconds": time.perf_counter() - started, **stats.model_dump()}


async def _template(cache: TemplateCache, store: ObjectStore, name: str, memory_mib: int,
                    digest: str, work: Path) -> dict[str, Any]:
    shipped = shipped_template(name)
    cache_name = shipped.cache_name if shipped is not None else name
    entries = cache.candidates(cache_name, digest, memory_mib, 1)
    manifest = cache.manifest(entries[0]) if entries else None
    if manifest is None:
        return {"skipped": f"no cached {name} template of this image on this host"}
    entry = entries[0]
    started = time.perf_counter()
    await asyncio.to_thread(TemplateCache(cache.root.parent, store).share, entry, manifest)
    pushed = time.perf_counter() - started
    fresh = TemplateCache(work / f"fresh-{name}", store)
    started = time.perf_counter()
    pulled = await asyncio.to_thread(fresh.fetch, cache_name, digest, memory_mib, 1, lambda _m: None)
    imported = time.perf_counter() - started
    return {"entry": entry.name, "bytes": sum(p.stat().st_size for p in entry.rglob("*") if p.is_file()),
            "push_seconds": pushed, "import_seconds": imported, "imported": len(pulled)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"host": host_facts(), "idle_s": args.idle, "backends": {}}
    work = Path(tempfile.mkdtemp(prefix="capsa-bench-fleet-", dir="/var/tmp"))
    os.chmod(work, 0o711)
    with ExitStack() as stack:
        stores: dict[str, ObjectStore] = {"directory": open_store((work / "store").as_uri())}
        if not args.no_s3:
            server = stack.enter_context(temporary_s3())
            for name, value in server.env().items():
                os.environ[name] = value
            server.make_bucket("bench")
            stores["s3"] = open_store("s3://bench/fleet", s3_endpoint=server.endpoint)
        settings = Settings(state_dir=work / "node", accel=args.accel)
        image = await asyncio.to_thread(ensure_image, settings)
        parts = await build_node(settings, image, node_id="bench")
        try:
            agent = parts.agent
            assert agent.snapshots is not None and parts.storage is not None
            runtime = agent.snapshots.runtime
            cache = TemplateCache(settings.cache_dir)
            for backend, store in stores.items():
                for template in args.templates:
                    got = await _template(cache, store, template, SIZES[template], image.digest,
                                          work / backend)
                    out["backends"].setdefault(backend, {}).setdefault(template, {})["template"] = got
                    print(f"{backend:9} template {template}: {got}", flush=True)
            for template in args.templates:
                memory = SIZES[template]
                sid = new_id("sbx")
                # A browser sandbox has a NIC, so it takes an egress policy (any: nothing is fetched).
                policy = (EgressPolicy.from_data({"domains": [{"domain": "api.allowed.test"}]})
                          if template != "base" else None)
                record = await agent.create(sid, template, memory, 1, {}, policy=policy)
                labels = {"capsa.tenant": "bench"}
                await asyncio.sleep(args.idle)
                first = await runtime.snapshot(record.sandbox, new_id("snap"), labels=labels)
                naive = await asyncio.to_thread(_naive, first)
                await asyncio.sleep(args.idle)
                second = await runtime.snapshot(record.sandbox, new_id("snap"), labels=labels)
                for backend, store in stores.items():
                    shipper = Shipper(store, parts.storage.snapshots_dir)
                    one = await _push(shipper, first)
                    two = await _push(shipper, second)
                    out["backends"][backend][template].update({
                        "first": one, "second": two, "naive_whole_files": naive,
                        "ratio_naive_to_first_bytes": naive["bytes"] / max(1, one["sent_bytes"]),
                        "ratio_naive_to_second_bytes": naive["bytes"] / max(1, two["sent_bytes"]),
                        "snapshot_bytes": sum(p.stat().st_size for p in first.path.iterdir() if p.is_file()),
                    })
                    print(f"{backend:9} {template:8} first {one['seconds']:6.2f} s "
                          f"{one['sent_bytes'] / 2**20:8.1f} MiB; second {two['seconds']:6.2f} s "
                          f"{two['sent_bytes'] / 2**20:8.1f} MiB; naive {naive['bytes'] / 2**20:8.1f} MiB",
                          flush=True)
                await agent.destroy(sid)
                for snap in (first, second):
                    runtime.delete_snapshot(snap)
        finally:
            await parts.close()
            shutil.rmtree(work, ignore_errors=True)
    out["host"]["loadavg_at_end"] = list(os.getloadavg())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--templates", nargs="+", default=["base", "browser"], choices=sorted(SIZES))
    parser.add_argument("--idle", type=float, default=20.0, help="seconds idle before each snapshot")
    parser.add_argument("--accel", default="auto")
    parser.add_argument("--no-s3", action="store_true", help="the directory backend only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    data = asyncio.run(run(args))
    write_results(args.out, data)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

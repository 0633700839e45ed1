"""The port proxy through the public API vs the guest channel alone, in one run on one sandbox.

Runs ``capsa.serve.run`` (control plane + local node, real microVM) on loopback. Inside the sandbox,
``python3 -m http.server`` serves a small file and a large one from /tmp/www. Measured through the API on
one keep-alive HTTP client:

- ``proxy_get_s``: ``GET /v1/sessions/{id}/ports/{port}/hello.txt`` (API -> node port tunnel -> guest
  ``tcp_open`` -> http.server), ``--requests`` times;
- ``exec_s``: ``POST /v1/sessions/{id}/commands`` running ``true`` (one guest channel exec), as many times;
- ``file_read_s``: ``GET /v1/sessions/{id}/files/content`` of the same small file (one guest channel read);
- the ``--download-mib`` file downloaded through the proxy and through the files API (throughput, MiB/s).

Writes ``bench/results/port_proxy.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from capsa import serve
from capsa.control.keys import generate_key
from harness import host_facts, summary, write_results

RESULTS = Path(__file__).with_name("results") / "port_proxy.json"
GUEST_PORT = 8000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_ready(url: str, server: asyncio.Task[None]) -> None:
    async with httpx.AsyncClient() as probe:
        for _ in range(1500):
            if server.done():
                server.result()
            with contextlib.suppress(httpx.HTTPError):
                if (await probe.get(f"{url}/v1/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError("capsa serve did not become ready")


async def _download(api: httpx.AsyncClient, route: str, **params: Any) -> tuple[int, float]:
    start = time.perf_counter()
    n = 0
    async with api.stream("GET", route, params=params) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            n += len(chunk)
    return n, time.perf_counter() - start


async def measure(url: str, key: str, requests: int, download_mib: int, memory_mib: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=600) as api:
        created = await api.post("/v1/sessions", json={"memory_mib": memory_mib, "timeout": 3600})
        created.raise_for_status()
        sid = created.json()["id"]
        try:
            setup = (f"mkdir -p /tmp/www && printf hello > /tmp/www/hello.txt && "
                     f"head -c {download_mib * 1024 * 1024} /dev/zero > /tmp/www/big.bin")
            (await api.post(f"/v1/sessions/{sid}/commands", json={"cmd": setup, "timeout": 300})
             ).raise_for_status()
            (await api.post(f"/v1/sessions/{sid}/commands", json={
                "cmd": f"exec python3 -m http.server {GUEST_PORT} --bind 127.0.0.1 --directory /tmp/www",
                "background": True})).raise_for_status()
            base = f"/v1/sessions/{sid}/ports/{GUEST_PORT}"
            small, big = "/tmp/www/hello.txt", "/tmp/www/big.bin"
            for _ in range(600):
                if (await api.get(f"{base}/hello.txt")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            samples: dict[str, list[float]] = {"proxy_get_s": [], "exec_s": [], "file_read_s": []}
            for _ in range(3):  # warm up each path (TCG translation caches, connections)
                await api.get(f"{base}/hello.txt")
                await api.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"})
                await api.get(f"/v1/sessions/{sid}/files/content", params={"path": small})
            for _ in range(requests):
                # Interleaved, so load changes during the run hit every path alike.
                start = time.perf_counter()
                response = await api.get(f"{base}/hello.txt")
                samples["proxy_get_s"].append(time.perf_counter() - start)
                assert response.content == b"hello", response.text
                start = time.perf_counter()
                (await api.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"})).raise_for_status()
                samples["exec_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                read = await api.get(f"/v1/sessions/{sid}/files/content", params={"path": small})
                samples["file_read_s"].append(time.perf_counter() - start)
                assert read.content == b"hello"
            proxy_n, proxy_s = await _download(api, f"{base}/big.bin")
            files_n, files_s = await _download(api, f"/v1/sessions/{sid}/files/content", path=big)
            assert proxy_n == files_n == download_mib * 1024 * 1024
        finally:
            await api.post(f"/v1/sessions/{sid}/close")
    figures = {name: summary(values) for name, values in samples.items()}
    return {
        "seconds": figures,
        "download": {"mib": download_mib, "proxy_s": round(proxy_s, 3), "files_api_s": round(files_s, 3),
                     "proxy_mib_s": round(download_mib / proxy_s, 1),
                     "files_api_mib_s": round(download_mib / files_s, 1)},
        "ratios_p50": {
            "proxy_get_vs_exec": round(figures["proxy_get_s"]["p50"] / figures["exec_s"]["p50"], 3),
            "proxy_get_vs_file_read": round(figures["proxy_get_s"]["p50"] / figures["file_read_s"]["p50"], 3),
            "proxy_download_vs_files_api": round(proxy_s / files_s, 3),
        },
        "added_latency_p50_ms": {
            "vs_exec": round((figures["proxy_get_s"]["p50"] - figures["exec_s"]["p50"]) * 1000, 2),
            "vs_file_read": round((figures["proxy_get_s"]["p50"] - figures["file_read_s"]["p50"]) * 1000, 2),
        },
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--download-mib", type=int, default=100)
    parser.add_argument("--memory", type=int, default=512, help="guest memory in MiB (/tmp holds the file)")
    parser.add_argument("--accel", default="tcg")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["CAPSA_POOL_SIZE"] = "0"
    key = generate_key().full
    os.environ["CAPSA_BOOTSTRAP_KEY"] = key
    state = Path(tempfile.mkdtemp(prefix="csbench-", dir="/var/tmp"))
    os.chmod(state, 0o711)  # QEMU runs as another uid
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve.run("127.0.0.1", port, state / "serve", None, args.accel))
    try:
        await _wait_ready(url, server)
        load_start = os.getloadavg()
        figures = await measure(url, key, args.requests, args.download_mib, args.memory)
        data: dict[str, Any] = {"host": host_facts(), "load_start": load_start, "load_end": os.getloadavg(),
                                "requests": args.requests, "memory_mib": args.memory, "accel": args.accel,
                                **figures}
        write_results(args.out, data)
        print(f"{'operation (through the API)':28} {'p50 ms':>8} {'p95 ms':>8} {'n':>4}")
        for name, fig in figures["seconds"].items():
            print(f"{name:28} {fig['p50'] * 1000:8.2f} {fig['p95'] * 1000:8.2f} {fig['n']:4d}")
        dl = figures["download"]
        print(f"{dl['mib']} MiB download: proxy {dl['proxy_mib_s']} MiB/s, "
              f"files API {dl['files_api_mib_s']} MiB/s")
        print(f"wrote {args.out}")
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())

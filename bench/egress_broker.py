"""Egress broker benchmark: latency added per request, requests per second, broker memory.

Three processes on loopback: an upstream (HTTP + HTTPS echo server with its own CA), the broker (one
sandbox registered, destinations resolved to the upstream, TLS intercepted with the sandbox CA and
re-originated with verification), and this client. Every scenario runs the same client code directly
against the upstream and through the broker, so the difference is the broker's cost. Writes
``bench/results/egress.json``.

    .venv/bin/python bench/egress_broker.py [--requests 1000] [--seconds 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import ssl
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: StaticResolver

from harness import memory_kib, summary, write_results

HOST = "api.bench.test"
BODY = b'{"ok": true, "data": "' + b"x" * 200 + b'"}'


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


# --- upstream process -------------------------------------------------------------------------------

async def _upstream_main(conn: Connection, ca_dir: str) -> None:
    from capsa.node.egress.ca import SandboxCA

    ca = SandboxCA("bench-world", [HOST])
    _write(Path(ca_dir, "world.pem"), ca.cert_pem)
    tls = ca.server_context(HOST)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    http = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    https = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls, backlog=1024)
    conn.send((http.sockets[0].getsockname()[1], https.sockets[0].getsockname()[1]))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop


def upstream_process(conn: Connection, ca_dir: str) -> None:
    asyncio.run(_upstream_main(conn, ca_dir))


# --- broker process ---------------------------------------------------------------------------------

async def _broker_main(conn: Connection, ca_dir: str, http_port: int, https_port: int) -> None:
    from tests.support.resolvers import StaticResolver

    from capsa.common.egress_policy import EgressPolicy
    from capsa.node.egress.audit import EgressEvent
    from capsa.node.egress.broker import EgressBroker
    from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
    from capsa.node.net.sandbox_net import ServicePorts

    events = 0

    def sink(_e: EgressEvent) -> None:
        nonlocal events
        events += 1

    broker = EgressBroker(
        secrets=InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_bench": "sk-bench-secret"}), sink=sink,
        resolver=StaticResolver({HOST: ["127.0.0.1"]}),
        upstream_ssl=ssl.create_default_context(cafile=str(Path(ca_dir, "world.pem"))),
        allow_networks=["127.0.0.0/8"], upstream_http_port=http_port, upstream_https_port=https_port)
    policy = EgressPolicy.from_data({
        "domains": [{"domain": HOST}],
        "secrets": [{"secret": "sec_bench", "domain": HOST, "header": "Authorization"}],
    })
    ports = ServicePorts(0, 0, 0, 0)
    sbx = broker.register("sbx_bench", "127.0.0.1", policy)
    await broker.listen("sbx_bench", "127.0.0.1", ports=ports)
    _write(Path(ca_dir, "sandbox.pem"), sbx.ca.cert_pem)
    conn.send({"http": sbx.bound["http"][1], "tls": sbx.bound["tls"][1],
               "placeholder": sbx.placeholder_for("sec_bench")})
    loop = asyncio.get_running_loop()
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        if cmd[0] == "register":
            for i in range(cmd[1]):
                sid = f"sbx_extra{i}"
                s = broker.register(sid, "127.0.0.1", policy)
                await broker.listen(sid, "127.0.0.1", ports=ports)
                s.ca.server_context(HOST)  # each sandbox has issued one leaf, as after first use
            conn.send(events)
        else:
            await broker.close()
            conn.send(events)
            return


def broker_process(conn: Connection, ca_dir: str, http_port: int, https_port: int) -> None:
    asyncio.run(_broker_main(conn, ca_dir, http_port, https_port))


# --- client -----------------------------------------------------------------------------------------

class Client:
    def __init__(self, port: int, ctx: ssl.SSLContext | None, headers: str = "") -> None:
        self.port, self.ctx, self.headers = port, ctx, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            "127.0.0.1", self.port, ssl=self.ctx, server_hostname=HOST if self.ctx else None)

    async def request(self) -> None:
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        self.writer.write(f"GET /v1/bench HTTP/1.1\r\nHost: {HOST}\r\n{self.headers}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected response: {head[:80]!r}")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await self.writer.wait_closed()
            self.writer = self.reader = None


def _pcts(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    s = summary(ordered)
    s["p99"] = ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}


async def latency(port: int, ctx: ssl.SSLContext | None, n: int, keep_alive: bool, headers: str = ""
                  ) -> dict[str, float]:
    client = Client(port, ctx, headers)
    samples: list[float] = []
    for _ in range(10):  # warm-up (leaf issuance, upstream connection)
        await client.request()
        if not keep_alive:
            await client.close()
    for _ in range(n):
        t0 = time.perf_counter()
        await client.request()
        if not keep_alive:
            await client.close()
        samples.append((time.perf_counter() - t0) * 1000)
    await client.close()
    return _pcts(samples)


async def throughput(port: int, ctx: ssl.SSLContext | None, seconds: float, concurrency: int) -> float:
    deadline = time.perf_counter() + seconds
    count = 0

    async def worker() -> None:
        nonlocal count
        client = Client(port, ctx)
        while time.perf_counter() < deadline:
            await client.request()
            count += 1
        await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx_mp = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="capsa-bench-egress-") as ca_dir:
        up_parent, up_child = ctx_mp.Pipe()
        upstream = ctx_mp.Process(target=upstream_process, args=(up_child, ca_dir), daemon=True)
        upstream.start()
        http_port, https_port = up_parent.recv()
        br_parent, br_child = ctx_mp.Pipe()
        broker = ctx_mp.Process(target=broker_process, args=(br_child, ca_dir, http_port, https_port),
                                daemon=True)
        broker.start()
        try:
            info = br_parent.recv()
            world_ctx = ssl.create_default_context(cafile=str(Path(ca_dir, "world.pem")))
            sandbox_ctx = ssl.create_default_context(cafile=str(Path(ca_dir, "sandbox.pem")))
            assert broker.pid is not None
            mem_start = memory_kib(broker.pid)
            # Sandboxes first, on a fresh heap: after the load phase freed memory would be reused.
            br_parent.send(("register", args.sandboxes))
            br_parent.recv()
            mem_many = memory_kib(broker.pid)
            n = args.requests
            results: dict[str, Any] = {"latency_ms": {}, "requests_per_second": {}}
            lat = results["latency_ms"]
            for name, keep in (("keepalive", True), ("new_connection", False)):
                lat[f"http_{name}"] = {
                    "direct": await latency(http_port, None, n, keep),
                    "broker": await latency(info["http"], None, n, keep)}
                lat[f"https_{name}"] = {
                    "direct": await latency(https_port, world_ctx, n, keep),
                    "broker": await latency(info["tls"], sandbox_ctx, n, keep)}
            lat["https_keepalive_secret_injected"] = {
                "direct": await latency(https_port, world_ctx, n, True, "Authorization: Bearer sk-x\r\n"),
                "broker": await latency(info["tls"], sandbox_ctx, n, True,
                                        f"Authorization: Bearer {info['placeholder']}\r\n")}
            for entry in lat.values():
                entry["added_p50_ms"] = round(entry["broker"]["p50"] - entry["direct"]["p50"], 4)
                entry["added_p99_ms"] = round(entry["broker"]["p99"] - entry["direct"]["p99"], 4)
                entry["ratio_p50"] = round(entry["broker"]["p50"] / entry["direct"]["p50"], 2)
            rps = results["requests_per_second"]
            for label, direct_port, broker_port, dctx, bctx in (
                ("http_keepalive", http_port, info["http"], None, None),
                ("https_keepalive", https_port, info["tls"], world_ctx, sandbox_ctx),
            ):
                d = await throughput(direct_port, dctx, args.seconds, args.concurrency)
                b = await throughput(broker_port, bctx, args.seconds, args.concurrency)
                rps[label] = {"direct": round(d, 1), "broker": round(b, 1), "ratio": round(b / d, 3),
                              "concurrency": args.concurrency}
            mem_busy = memory_kib(broker.pid)
            results["broker_memory_kib"] = {
                "after_start_1_sandbox": mem_start,
                f"with_{args.sandboxes + 1}_idle_sandboxes": mem_many,
                "after_load": mem_busy,
                "per_extra_sandbox_rss_kib": round((mem_many["rss"] - mem_start["rss"]) / args.sandboxes, 1),
            }
            br_parent.send(("stop",))
            results["audit_events"] = br_parent.recv()
        finally:
            up_parent.send("stop")
            for p in (broker, upstream):
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sandboxes", type=int, default=100)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "egress.json")
    args = parser.parse_args()
    import platform

    facts = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
             "loadavg_at_start": list(os.getloadavg()),
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results = asyncio.run(run(args))
    facts["loadavg_at_end"] = list(os.getloadavg())
    data = {"benchmark": "egress_broker", "host": facts,
            "setup": {"requests": args.requests,
                      "transport": "loopback, 3 processes (client, broker, upstream)",
                      "response_body_bytes": len(BODY)}, **results}
    write_results(args.out, data)
    print(f"{'scenario':36} {'direct p50':>10} {'broker p50':>10} {'direct p99':>10} {'broker p99':>10}"
          f" {'added p50':>9}")
    for name, e in results["latency_ms"].items():
        print(f"{name:36} {e['direct']['p50']:10.3f} {e['broker']['p50']:10.3f} {e['direct']['p99']:10.3f}"
              f" {e['broker']['p99']:10.3f} {e['added_p50_ms']:9.3f}")
    for name, r in results["requests_per_second"].items():
        print(f"rps {name:32} direct {r['direct']:9.1f}  broker {r['broker']:9.1f}  ratio {r['ratio']}")
    m = results["broker_memory_kib"]
    print(f"broker RSS: start {m['after_start_1_sandbox']['rss']} KiB, "
          f"after load {m['after_load']['rss']} KiB, "
          f"per extra sandbox {m['per_extra_sandbox_rss_kib']} KiB")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()

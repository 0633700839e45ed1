"""Connection token injection in the egress broker: the latency a warm access token adds per request
compared with a static secret's placeholder swap (and with no credential at all), and a refresh under
100 concurrent requests (how many fetches, how long the requests waited).

Broker and an HTTPS upstream in this process on loopback (no VM, no root): the broker intercepts TLS with
the sandbox CA and re-originates it with verification, as for a real sandbox. The token source stands in
for the node's link to the control plane and answers after ``--fetch-ms`` (the control plane's refresh
round trip to the provider; measure that separately, it is the provider's latency). Writes
``bench/results/oauth_injection.json``.

    .venv/bin/python bench/oauth_injection.py [--requests 2000] [--concurrency 100] [--fetch-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support: StaticResolver

from tests.support.resolvers import StaticResolver

from capsa.common.connection_wire import ConnectionTokenOut
from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.net.sandbox_net import ServicePorts
from harness import host_facts, summary, write_results

HOSTS = {"plain": "plain.bench.test", "secret": "secret.bench.test", "token": "token.bench.test"}
CONN = "con_" + "b" * 20
SECRET_ID = "sec_" + "b" * 20
BODY = b'{"ok": true}'


class Source:
    """The token source: a new token per fetch after ``delay`` seconds; counts fetches."""

    def __init__(self, delay: float, lifetime: float) -> None:
        self.delay, self.lifetime, self.fetches = delay, lifetime, 0

    async def __call__(self, session_id: str, connection_id: str) -> ConnectionTokenOut:
        self.fetches += 1
        await asyncio.sleep(self.delay)
        return ConnectionTokenOut(access_token="at-" + secrets.token_hex(20), expires_in=self.lifetime,
                                  lifetime=self.lifetime)


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


class Client:
    """One keep-alive HTTPS connection to the broker's TLS listener for ``host``."""

    def __init__(self, port: int, ca_pem: bytes, host: str, headers: str) -> None:
        self.port, self.host, self.headers = port, host, headers
        self.ctx = ssl.create_default_context(cadata=ca_pem.decode())
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self) -> int:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port, ssl=self.ctx,
                                                      server_hostname=self.host)
        reader, writer = self.conn
        writer.write(f"GET /v1/x HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        status = int(head.split()[1])
        if b"connection: close" in head.lower():
            await self.close()
        return status

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


def _ms(values: list[float]) -> dict[str, float]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(values).items()}


async def _latency(client: Client, n: int) -> dict[str, float]:
    for _ in range(20):
        assert await client.request() == 200
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert await client.request() == 200
        samples.append((time.perf_counter() - t0) * 1000)
    await client.close()
    return _ms(samples)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="capsa-bench-oauth-"))
    world = SandboxCA("bench-world", ["bench.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def pick(obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
        obj.context = world.server_context(name or HOSTS["plain"])

    tls.sni_callback = pick
    upstream = await asyncio.start_server(_upstream, "127.0.0.1", 0, ssl=tls)
    (tmp / "world.pem").write_bytes(world.cert_pem)
    source = Source(args.fetch_ms / 1000, lifetime=3600)
    secret = "sk-" + secrets.token_hex(20)
    broker = EgressBroker(
        secrets=InMemorySecretStore(SecretBox(os.urandom(32)), {SECRET_ID: secret}), sink=ListSink(),
        resolver=StaticResolver({h: ["127.0.0.1"] for h in HOSTS.values()}),
        upstream_ssl=ssl.create_default_context(cafile=str(tmp / "world.pem")),
        allow_networks=["127.0.0.0/8"],
        upstream_https_port=upstream.sockets[0].getsockname()[1], tokens=ConnectionTokens(source))
    policy = EgressPolicy.from_data({
        "domains": [{"domain": h} for h in HOSTS.values()],
        "secrets": [{"secret": SECRET_ID, "domain": HOSTS["secret"], "header": "Authorization"}],
        "connections": [{"connection": CONN, "domains": [HOSTS["token"]]}]})
    sbx = broker.register("sbx_bench", "127.0.0.1", policy, session_id="ses_bench")
    await broker.listen("sbx_bench", "127.0.0.1", ports=ServicePorts(http=0, tls=0, proxy=0, dns=0))
    port = sbx.bound["tls"][1]
    ph = sbx.placeholder_for(SECRET_ID)
    out: dict[str, Any] = {"host": host_facts(), "requests": args.requests, "fetch_ms": args.fetch_ms}
    try:
        # Warm token: fetched once before measuring (the warm-up requests).
        out["latency_ms"] = {
            "no_credential": await _latency(Client(port, sbx.ca.cert_pem, HOSTS["plain"], ""), args.requests),
            "static_secret": await _latency(Client(port, sbx.ca.cert_pem, HOSTS["secret"],
                                                   f"Authorization: Bearer {ph}\r\n"), args.requests),
            "warm_token": await _latency(Client(port, sbx.ca.cert_pem, HOSTS["token"], ""), args.requests),
        }
        lat = out["latency_ms"]
        out["added_ms_p50"] = {
            "static_secret_vs_none": round(lat["static_secret"]["p50"] - lat["no_credential"]["p50"], 4),
            "warm_token_vs_none": round(lat["warm_token"]["p50"] - lat["no_credential"]["p50"], 4),
            "warm_token_vs_static_secret": round(lat["warm_token"]["p50"] - lat["static_secret"]["p50"], 4),
        }

        async def burst(label: str) -> dict[str, Any]:
            clients = [Client(port, sbx.ca.cert_pem, HOSTS["token"], "") for _ in range(args.concurrency)]
            for c in clients:  # connections open (TLS done) before the clock starts: the burst is requests
                assert await c.request() == 200
            if label == "expired":
                broker.tokens.forget(CONN)  # as after expiry: the next request must fetch
            before = source.fetches
            gate = asyncio.Event()

            async def one(c: Client) -> float:
                await gate.wait()
                t0 = time.perf_counter()
                assert await c.request() == 200
                return (time.perf_counter() - t0) * 1000

            tasks = [asyncio.create_task(one(c)) for c in clients]
            await asyncio.sleep(0.05)
            gate.set()
            t0 = time.perf_counter()
            samples = await asyncio.gather(*tasks)
            wall = (time.perf_counter() - t0) * 1000
            for c in clients:
                await c.close()
            return {"fetches": source.fetches - before, "request_ms": _ms(list(samples)),
                    "wall_ms": round(wall, 3)}

        out["concurrent"] = {"concurrency": args.concurrency, "warm": await burst("warm"),
                             "expired": await burst("expired")}
    finally:
        await broker.close()
        upstream.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--fetch-ms", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/oauth_injection.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    result["host"]["loadavg_at_end"] = list(os.getloadavg())
    write_results(args.out, result)
    lat = result["latency_ms"]
    for name in ("no_credential", "static_secret", "warm_token"):
        print(f"{name:14} p50 {lat[name]['p50']:.3f} ms  p95 {lat[name]['p95']:.3f} ms")
    print("added p50:", result["added_ms_p50"])
    for name in ("warm", "expired"):
        burst = result["concurrent"][name]
        print(f"{args.concurrency} concurrent, {name} token: {burst['fetches']} fetch(es), "
              f"p50 {burst['request_ms']['p50']:.1f} ms, max {burst['request_ms']['max']:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

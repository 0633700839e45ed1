"""Attacks on the egress broker itself, on loopback (findings 2, 5, 6, 9, 11, 12 of the security review).

The broker runs in this process with loopback upstreams (allowed through ``allow_networks``); the attacker
is this test speaking as the sandbox. Each test performs the attack and asserts the bound that the fix
promises; the numbers it measures are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import gc
import gzip
import json
import logging
import os
import resource
import socket
import ssl
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest

from capsa.common.egress_policy import EgressPolicy
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.limits import BrokerLimits
from capsa.node.egress.sandboxes import SandboxEgress
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(300)

SECRET = "sk/live+Tok=" + os.urandom(12).hex() + "/end"
# A value the control plane now refuses, held by a node all the same: h11 refuses to send it and its error
# message quotes the header.
ODD_SECRET = "sk-odd-" + os.urandom(8).hex() + " "
MiB = 1024 * 1024
ANY = ServicePorts(http=0, tls=0, proxy=0, dns=0)


def _rss() -> int:
    """This process's resident set, after giving freed heap pages back (so it counts what is held)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _rss_until(base: int, done: Callable[[], bool], within: float) -> tuple[int, bool]:
    """Sample :func:`_rss` every half second until ``done()`` (checked before each sample, so the last
    one is taken after the attack was served) or ``within`` seconds; (the most it grew over ``base``,
    whether ``done()`` came true)."""
    deadline = time.monotonic() + within
    peak = 0
    while True:
        finished = done()
        peak = max(peak, _rss() - base)
        if finished or time.monotonic() >= deadline:
            return peak, finished
        await asyncio.sleep(0.5)


# -- upstreams -------------------------------------------------------------------------------------

Reply = Callable[[h11.Request, bytes], Awaitable[tuple[list[tuple[bytes, bytes]], bytes | None, int]]]


@dataclass
class Upstream:
    """An h11 server on loopback whose answer a ``reply`` function makes (``None`` body: a streamed one)."""

    reply: Reply
    stream_size: int = 0
    seen: list[dict[bytes, bytes]] = field(default_factory=list)
    received: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        req: h11.Request | None = None
        body = bytearray()
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(ev, h11.Request):
                    req, body = ev, bytearray()
                    self.seen.append(dict(ev.headers))
                elif isinstance(ev, h11.Data):
                    self.received += len(ev.data)
                    if len(body) < 4096:
                        body += ev.data
                elif isinstance(ev, h11.EndOfMessage) and req is not None:
                    headers, out, status = await self.reply(req, bytes(body))
                    if out is None:
                        headers = [*headers, (b"content-length", str(self.stream_size).encode())]
                    writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
                    if out is None:
                        piece = b"x" * 65536
                        for _ in range(self.stream_size // len(piece)):
                            writer.write(conn.send(h11.Data(data=piece)) or b"")
                            await writer.drain()
                    elif out:
                        writer.write(conn.send(h11.Data(data=out)) or b"")
                    writer.write(conn.send(h11.EndOfMessage()) or b"")
                    await writer.drain()
                    conn.start_next_cycle()
                else:
                    return
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()


def _echo_forms(auth: bytes, path: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """What a reflecting upstream sends back for ``path``: the Authorization header in some encoding."""
    value = auth.decode()
    token = value.removeprefix("Bearer ")
    forms: dict[str, tuple[bytes, bytes]] = {
        "raw": (b"text/plain", auth),
        "base64": (b"text/plain", base64.b64encode(b"Authorization: " + auth)),
        "base64url": (b"text/plain", base64.urlsafe_b64encode(b"x" + auth)),
        "json": (b"application/json", json.dumps({"headers": {"authorization": value}}).replace(
            "/", "\\/").encode()),
        "json-unicode": (b"application/json", "".join(f"\\u{ord(c):04x}" for c in token).encode()),
        "percent-lower": (b"text/plain", "".join(f"%{b:02x}" for b in token.encode()).encode()),
        "percent-mixed": (b"text/plain", token.replace("/", "%2f").replace("+", "%2B").replace("=", "%3d")
                          .encode()),
        "header": (b"text/plain", b"see header"),
    }
    ctype, body = forms[path.strip("/").split("/")[-1]]
    headers = [(b"content-type", ctype)]
    if path.endswith("header"):
        headers.append((b"x-echo", auth))
    return headers, b"{" + body + b"}"


async def _echo(req: h11.Request, _body: bytes) -> tuple[list[tuple[bytes, bytes]], bytes | None, int]:
    auth = dict(req.headers).get(b"authorization", b"-")
    path = req.target.decode()
    if path.startswith("/trunc"):
        return [], b"partial: " + auth.removeprefix(b"Bearer ")[:20] + b" ...", 200
    if path.startswith("/gzip"):
        return [(b"content-encoding", b"gzip")], gzip.compress(b"token " + auth), 200
    if path.startswith("/big"):
        return [], None, 200
    if path.startswith("/sink"):
        return [], b"ok", 200
    headers, out = _echo_forms(auth, path)
    return headers, out, 200


# -- the world -------------------------------------------------------------------------------------


class Range:
    def __init__(self, tmp: Path, upstream: Upstream) -> None:
        self.tmp, self.upstream = tmp, upstream
        self.sink = ListSink()
        self.store = InMemorySecretStore(SecretBox(os.urandom(32)), {"sec_1": SECRET, "sec_odd": ODD_SECRET})
        self.world_ca = SandboxCA("world", ["api.test", "odd.test", "w.test", "*.w.test"])
        self.servers: list[asyncio.AbstractServer] = []
        self.brokers: list[EgressBroker] = []

    async def start(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

        def pick(obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
            obj.context = self.world_ca.server_context(name or "api.test")

        ctx.sni_callback = pick
        self.https = await asyncio.start_server(self.upstream.handle, "127.0.0.1", 0, ssl=ctx)
        self.http = await asyncio.start_server(self.upstream.handle, "127.0.0.1", 0)
        self.servers += [self.https, self.http]
        (self.tmp / "world.pem").write_bytes(self.world_ca.cert_pem)

    def broker(self, limits: BrokerLimits | None = None) -> EgressBroker:
        names = ["api.test", "odd.test", "w.test"]
        broker = EgressBroker(
            secrets=self.store, sink=self.sink,
            resolver=StaticResolver({n: ["127.0.0.1"] for n in names}),
            upstream_ssl=ssl.create_default_context(cafile=str(self.tmp / "world.pem")),
            allow_networks=["127.0.0.0/8"],
            upstream_http_port=self.http.sockets[0].getsockname()[1],
            upstream_https_port=self.https.sockets[0].getsockname()[1], limits=limits)
        self.brokers.append(broker)
        return broker

    async def sandbox(self, broker: EgressBroker, policy: Mapping[str, object]) -> SandboxEgress:
        sid = f"sbx_{len(self.brokers)}_{len(broker._sandboxes)}"
        sbx = broker.register(sid, "127.0.0.1", EgressPolicy.from_data(dict(policy)))
        await broker.listen(sid, "127.0.0.1", ports=ANY)
        return sbx

    async def close(self) -> None:
        for b in self.brokers:
            await b.close()
        for s in self.servers:
            s.close()


@pytest.fixture
async def echo_range(tmp_path: Path) -> AsyncIterator[Range]:
    r = Range(tmp_path, Upstream(_echo))
    await r.start()
    yield r
    await r.close()


BOUND = {"domains": [{"domain": "api.test"}, {"domain": "odd.test"}],
         "secrets": [{"secret": "sec_1", "domain": "api.test"}, {"secret": "sec_odd", "domain": "odd.test"}]}


async def _tls_request(sbx: SandboxEgress, host: str, head: str, *, read_all: bool = True,
                       rcvbuf: int | None = None) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """``rcvbuf``: the client socket's receive buffer, fixed (no autotuning up to net.ipv4.tcp_rmem)."""
    ctx = ssl.create_default_context(cadata=sbx.ca.cert_pem.decode())
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", sbx.bound["tls"][1]))
    except OSError:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock, ssl=ctx, server_hostname=host)
    writer.write(head.encode())
    data = b""
    if read_all:
        data = await asyncio.wait_for(_read_to_eof(reader), 30)
        writer.close()
    return data, reader, writer


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    out = b""
    try:
        while chunk := await reader.read(65536):
            out += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return out


def _secret_forms(secret: str) -> list[bytes]:
    raw = secret.encode()
    return [raw, raw[:20], base64.b64encode(raw)[4:24], raw.replace(b"/", b"\\/"),
            "".join(f"%{b:02x}" for b in raw).encode()[:30]]


# -- finding 5: encoded echoes ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["raw", "base64", "base64url", "json", "json-unicode", "percent-lower",
                                  "percent-mixed", "header"])
async def test_encoded_secret_echoes_come_back_redacted(echo_range: Range, form: str) -> None:
    broker = echo_range.broker()
    sbx = await echo_range.sandbox(broker, BOUND)
    ph = sbx.placeholder_for("sec_1")
    data, _r, _w = await _tls_request(sbx, "api.test", f"GET /echo/{form} HTTP/1.1\r\nHost: api.test\r\n"
                                      f"Authorization: Bearer {ph}\r\nConnection: close\r\n\r\n")
    print(form, data.split(b"\r\n\r\n", 1)[-1][:160])
    assert data.startswith(b"HTTP/1.1 200") and b"[REDACTED]" in data
    assert echo_range.upstream.seen[-1][b"authorization"] == f"Bearer {SECRET}".encode()
    for needle in _secret_forms(SECRET):
        assert needle not in data, (form, needle)


async def test_truncated_echo_is_refused(echo_range: Range) -> None:
    broker = echo_range.broker()
    sbx = await echo_range.sandbox(broker, BOUND)
    ph = sbx.placeholder_for("sec_1")
    data, _r, _w = await _tls_request(sbx, "api.test", "GET /trunc HTTP/1.1\r\nHost: api.test\r\n"
                                      f"Authorization: Bearer {ph}\r\nConnection: close\r\n\r\n")
    assert SECRET.encode()[:20] not in data and SECRET.encode()[:12] not in data
    assert not data.endswith(b"0\r\n\r\n")  # the body was cut off, never completed
    assert echo_range.sink.find(kind="http", decision="deny",
                                reason="response holds part of a secret (cut off)")


async def test_compressed_response_from_a_bound_host_is_refused_even_without_a_secret(echo_range: Range
                                                                                       ) -> None:
    broker = echo_range.broker()
    sbx = await echo_range.sandbox(broker, BOUND)
    data, _r, _w = await _tls_request(sbx, "api.test", "GET /gzip HTTP/1.1\r\nHost: api.test\r\n"
                                      "Accept-Encoding: gzip\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 502")
    # The broker asked for identity on every request to a destination a secret is bound to.
    assert echo_range.upstream.seen[-1][b"accept-encoding"] == b"identity"


# -- finding 11 and 12: nothing from a header in the log, no traceback for a bad port -----------------


async def test_unsendable_secret_and_bad_ports_leave_no_trace_in_the_log(
        echo_range: Range, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    broker = echo_range.broker()
    sbx = await echo_range.sandbox(broker, BOUND)
    ph = sbx.placeholder_for("sec_odd")
    data, _r, _w = await _tls_request(sbx, "odd.test", "GET /sink HTTP/1.1\r\nHost: odd.test\r\n"
                                      f"Authorization: Bearer {ph}\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400")
    port = sbx.bound["proxy"][1]
    for head in ("GET http://api.test:99999/ HTTP/1.1\r\nHost: api.test:99999\r\n\r\n",
                 "GET http://api.test:99999/ HTTP/1.1\r\nHost: api.test\r\n\r\n",
                 "GET http://api.test:8x/ HTTP/1.1\r\nHost: api.test\r\n\r\n",
                 "GET http://[::1/ HTTP/1.1\r\nHost: [::1\r\n\r\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode())
        answer = await asyncio.wait_for(_read_to_eof(reader), 10)
        print(head.split(" HTTP")[0], answer[:40])
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400"), (head, answer[:80])
    text = caplog.text
    assert "Traceback" not in text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert ODD_SECRET.strip() not in text and SECRET not in text
    events = [e.reason or "" for e in echo_range.sink.events]
    assert not [r for r in events if ODD_SECRET.strip() in r]


# -- findings 2 and 9: memory and time one sandbox can hold -----------------------------------------


@pytest.fixture
async def sink_range(tmp_path: Path) -> AsyncIterator[Range]:
    r = Range(tmp_path, Upstream(_echo, stream_size=8 * MiB))
    await r.start()
    yield r
    await r.close()


async def test_256_trickling_uploads_keep_broker_memory_bounded(sink_range: Range) -> None:
    """256 connections each send 4 MiB of an 8 MiB body and then trickle: the broker streams what it got
    to the upstream instead of holding it (before the fix: 256 x 4 MiB = 1 GiB held)."""
    # The budget covers this whole process: the broker, and the 256 clients and the upstream on its loop.
    conns, sent_each, budget = 256, 4 * MiB, 192 * MiB
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    broker = sink_range.broker()
    sbx = await sink_range.sandbox(broker, {"domains": [{"domain": "api.test"}],
                                            "max_request_bytes": 16 * MiB})
    port = sbx.bound["http"][1]
    piece = b"u" * 65536
    base = _rss()
    writers: list[asyncio.StreamWriter] = []

    async def upload() -> None:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(b"POST /sink HTTP/1.1\r\nHost: api.test\r\nContent-Length: %d\r\n\r\n" % (8 * MiB))
        for _ in range(sent_each // len(piece)):
            writer.write(piece)
            await writer.drain()

    start = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(upload() for _ in range(conns))), 120)
    # Trickling: nothing more comes. Measure until the broker has consumed the whole flood, i.e. streamed
    # every byte sent on to the upstream (on this loop; about 7 s after the last write here, idle): memory
    # measured before then would not count what a broker holding the bodies holds. Before the fix the
    # upstream got nothing until a body was complete.
    total = conns * sent_each
    peak, consumed = await _rss_until(base, lambda: sink_range.upstream.received >= total, 120)
    held = broker.budget.peak
    print(f"\n256 uploads x {sent_each // MiB} MiB sent in {time.monotonic() - start:.1f} s: broker+test RSS "
          f"+{peak / MiB:.1f} MiB at most (budget {budget // MiB} MiB), reserved buffers peak "
          f"{held / MiB:.1f} MiB, upstream got {sink_range.upstream.received / MiB:.0f} MiB, active "
          f"connections {broker.active}")
    assert consumed, f"upstream got {sink_range.upstream.received / MiB:.0f} of {total // MiB} MiB"
    assert broker.active == conns
    assert peak < budget
    assert held <= broker.limits.buffer_bytes_per_sandbox
    for w in writers:
        w.close()


async def test_large_bound_host_responses_to_stalled_readers_stay_bounded(sink_range: Range) -> None:
    """64 TLS clients ask a bound host for 8 MiB each and read nothing: the broker redacts as it streams and
    stops reading the upstream when the sandbox does not read (before the fix: 64 x 8 MiB read whole)."""
    # The budget covers this whole process, with four TLS endpoints per connection (client, broker both
    # sides, upstream: ~3 MiB of TLS and stream buffers together); the bodies held before the fix would
    # add 64 x 8 MiB = 512 MiB on top.
    conns, budget = 64, 320 * MiB
    broker = sink_range.broker()
    sbx = await sink_range.sandbox(broker, BOUND)
    base = _rss()

    async def stalled_reader() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # Its kernel takes no more than a small receive buffer (autotuned, a loopback socket's grows to
        # net.ipv4.tcp_rmem's maximum, 32 MiB here: the whole answer, and no reader would ever stall).
        _d, reader, writer = await _tls_request(sbx, "api.test",
                                                "GET /big HTTP/1.1\r\nHost: api.test\r\n\r\n", read_all=False,
                                                rcvbuf=64 * 1024)
        # The answer's head: the broker has taken the request and answers it (before the fix, only once it
        # had read the whole body). Then it reads nothing more.
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return reader, writer

    # All at once (one by one, on a busy host, the first had stalled for the broker's rate_grace, 30 s, and
    # was cut before the last asked). Memory is sampled throughout, and once more after every answer began.
    async def all_stalled() -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        return await asyncio.gather(*(stalled_reader() for _ in range(conns)))

    start = time.monotonic()
    attack = asyncio.create_task(all_stalled())
    peak, answered = await _rss_until(base, attack.done, 120)
    assert answered, "the broker did not answer every request within 120 s"
    held = attack.result()
    print(f"\n64 stalled 8 MiB bound-host responses, all answering after {time.monotonic() - start:.1f} s: "
          f"RSS +{peak / MiB:.1f} MiB at most (budget {budget // MiB} MiB), reserved buffers peak "
          f"{broker.budget.peak / MiB:.1f} MiB")
    assert peak < budget
    # And a reader that does read gets all of it, redacted on the way, framed as chunked.
    reader, _writer = held[0]
    body = await asyncio.wait_for(_read_until(reader, 8 * MiB), 60)
    assert body >= 8 * MiB
    for _r, w in held:
        w.close()


async def _read_until(reader: asyncio.StreamReader, n: int) -> int:
    got = 0
    while got < n:
        chunk = await reader.read(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    return got


async def test_trickled_heads_and_bodies_are_cut_off(echo_range: Range) -> None:
    limits = BrokerLimits(head_timeout=1.0, min_rate=1024.0, rate_grace=1.0)
    broker = echo_range.broker(limits)
    sbx = await echo_range.sandbox(broker, {"domains": [{"domain": "api.test"}]})
    port = sbx.bound["http"][1]

    async def trickle(first: bytes, drip: bytes) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first)
        start = time.monotonic()
        try:
            while time.monotonic() - start < 20:
                writer.write(drip)
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(4096), 0.3)
                except TimeoutError:
                    continue
                break  # an answer or the end: the broker gave up on this connection
        except ConnectionError:
            pass
        writer.close()
        return time.monotonic() - start

    head_held = await trickle(b"GET /sink HTTP/1.1\r\n", b"X-Drip: 1\r\n")
    body_held = await trickle(b"POST /sink HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100000\r\n\r\n",
                              b"b")
    print(f"\ntrickled head cut after {head_held:.1f} s, trickled body after {body_held:.1f} s")
    assert head_held < 5 and body_held < 5


async def test_node_wide_connection_cap(echo_range: Range) -> None:
    broker = echo_range.broker(BrokerLimits(connections_total=8, connections_per_sandbox=6))
    a = await echo_range.sandbox(broker, {"domains": [{"domain": "api.test"}]})
    b = await echo_range.sandbox(broker, {"domains": [{"domain": "api.test"}]})
    assert broker.connection_cap == 8
    opened = [await asyncio.open_connection("127.0.0.1", a.bound["http"][1]) for _ in range(7)]
    opened += [await asyncio.open_connection("127.0.0.1", b.bound["http"][1]) for _ in range(4)]
    await asyncio.sleep(0.3)
    assert broker.active == 8 and len(a.tasks) == 6 and len(b.tasks) == 2
    reasons = {e.reason for e in echo_range.sink.events}
    assert {"too many concurrent connections", "the node's egress connection cap is reached"} <= reasons
    for _r, w in opened:
        w.close()
    await asyncio.sleep(0.3)
    assert broker.active == 0


# -- finding 6: wildcard names ---------------------------------------------------------------------


_HELLO_CTX = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no trust store: only its ClientHello is used


def _client_hello(name: str) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = _HELLO_CTX.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def test_10000_sni_names_under_a_wildcard_keep_the_loop_responsive(echo_range: Range) -> None:
    broker = echo_range.broker()
    sbx = await echo_range.sandbox(broker, {"domains": [{"domain": "*.w.test"}]})
    port = sbx.bound["tls"][1]
    names = [f"n{i}.w.test" for i in range(10_000)]
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - t - 0.005)

    async def hello(name: str) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_client_hello(name))
        await reader.read(1)  # the ServerHello came: the leaf was chosen
        writer.close()

    base = _rss()
    probing = asyncio.create_task(probe())
    start = time.monotonic()
    sem = asyncio.Semaphore(32)

    async def limited(name: str) -> None:
        async with sem:
            await hello(name)

    for batch in range(0, len(names), 500):
        await asyncio.gather(*(limited(n) for n in names[batch:batch + 500]))
    took = time.monotonic() - start
    stop.set()
    await probing
    grown = _rss() - base
    p99 = statistics.quantiles(lags, n=100)[98]
    print(f"\n10,000 SNI names in {took:.1f} s: leaves issued {sbx.ca.issued}, cached {sbx.ca.cached}, "
          f"loop lag p50 {statistics.median(lags) * 1000:.1f} ms p99 {p99 * 1000:.1f} ms max "
          f"{max(lags) * 1000:.1f} ms, RSS +{grown / MiB:.1f} MiB")
    # What kept the loop busy was a leaf (an RSA key) per name: one wildcard leaf, issued once, is the
    # outcome that shows it cannot. The loop lag is printed, not asserted: under CI it depends on what
    # else the two cores run (a p99 of 0.29 s was seen with a template build beside it).
    assert sbx.ca.issued == 1 and sbx.ca.cached == 1
    assert grown < 64 * MiB  # before the fix: ~47 KiB per name, 470 MiB
    # Names one level deeper each need a wildcard of their own parent: issued, but the cache stays bounded.
    for i in range(80):
        await hello(f"x.d{i}.w.test")
    assert sbx.ca.cached <= 64

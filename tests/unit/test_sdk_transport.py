"""The SDK's h11 transport against a loopback HTTP/1.1 server that counts its connections: reuse, what ends
reuse (the server closing, ``Connection: close``, a response closed early, expiry), streamed bodies both
ways, timeouts and errors as httpx's types, TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import httpx
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from capsa.sdk import transport as transport_module
from capsa.sdk.transport import H11Transport


class _Server:
    """Answers by path: ``/echo`` the body, ``/close`` with ``Connection: close``, ``/slow`` after 2 s,
    ``/stream`` three chunked pieces, ``/big`` 1 MiB; ``/hangup`` closes without answering."""

    def __init__(self) -> None:
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = b""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request, body = event, b""
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert request is not None
                    if not await self._answer(conn, writer, request.target, body):
                        return
                    conn.start_next_cycle()
                else:
                    return
        except (ConnectionError, h11.ProtocolError, asyncio.CancelledError):
            pass  # the client went away, or the test ended while /slow slept
        finally:
            writer.close()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, path: bytes,
                      body: bytes) -> bool:
        def send(*events: h11.Event) -> None:
            writer.write(b"".join(conn.send(e) or b"" for e in events))

        if path == b"/hangup":
            return False
        if path == b"/slow":
            await asyncio.sleep(2)
        if path == b"/stream":
            send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
            for piece in (b"one", b"two", b"three"):
                send(h11.Data(data=piece))
                await writer.drain()
                await asyncio.sleep(0.05)
            send(h11.EndOfMessage())
            await writer.drain()
            return True
        payload = {b"/big": b"x" * (1 << 20)}.get(path, body)
        headers = [(b"content-length", str(len(payload)).encode())]
        if path == b"/close":
            headers.append((b"connection", b"close"))
        send(h11.Response(status_code=200, headers=headers), h11.Data(data=payload), h11.EndOfMessage())
        await writer.drain()
        return path != b"/close"


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[_Server, str]]:
    s = _Server()
    s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    port = s.server.sockets[0].getsockname()[1]
    try:
        yield s, f"http://127.0.0.1:{port}"
    finally:
        s.server.close()
        for w in s.writers:
            w.close()


def _client(url: str, **kwargs: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=H11Transport(**kwargs))  # type: ignore[arg-type]


async def test_requests_share_one_kept_alive_connection(server: tuple[_Server, str]) -> None:
    s, url = server
    async with _client(url) as client:
        for i in range(5):
            r = await client.post("/echo", content=f"body {i}".encode())
            assert (r.status_code, r.content) == (200, f"body {i}".encode())
        assert s.connections == 1


async def test_concurrent_requests_open_connections_and_keep_them(server: tuple[_Server, str]) -> None:
    s, url = server
    async with _client(url) as client:
        got = await asyncio.gather(*(client.post("/echo", content=str(i).encode()) for i in range(4)))
        assert [r.content for r in got] == [str(i).encode() for i in range(4)]
        assert s.connections == 4
        for _ in range(4):
            await client.get("/echo")
        assert s.connections == 4


async def test_what_ends_reuse(server: tuple[_Server, str], monkeypatch: pytest.MonkeyPatch) -> None:
    s, url = server
    async with _client(url) as client:
        assert (await client.get("/close")).status_code == 200
        await client.get("/echo")
        assert s.connections == 2  # Connection: close was honoured
        # The server closes the idle connection: the next request notices and opens a new one.
        for w in s.writers:
            w.close()
        await asyncio.sleep(0.1)
        assert (await client.post("/echo", content=b"after close")).content == b"after close"
        assert s.connections == 3
        # A response closed before its end takes its connection with it.
        async with client.stream("GET", "/big") as r:
            async for _ in r.aiter_raw():
                break
        assert (await client.get("/echo")).status_code == 200
        assert s.connections == 4
        # An idle connection past its expiry is not reused.
        monkeypatch.setattr(transport_module, "KEEPALIVE_EXPIRY", 0.05)
        await asyncio.sleep(0.1)
        await client.get("/echo")
        assert s.connections == 5


async def test_bodies_stream_both_ways(server: tuple[_Server, str]) -> None:
    s, url = server

    async def upload() -> AsyncIterator[bytes]:
        for i in range(50):
            yield bytes([i]) * 10_000

    async with _client(url) as client:
        r = await client.post("/echo", content=upload())  # chunked: no length known
        assert r.content == b"".join(bytes([i]) * 10_000 for i in range(50))
        pieces = []
        async with client.stream("GET", "/stream") as streamed:
            async for piece in streamed.aiter_raw():
                pieces.append(piece)
        assert b"".join(pieces) == b"onetwothree" and len(pieces) == 3
        assert len((await client.get("/big")).content) == 1 << 20
        assert s.connections == 1


async def test_errors_are_httpx_errors(server: tuple[_Server, str]) -> None:
    s, url = server
    async with _client(url) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/slow", timeout=httpx.Timeout(5, read=0.2))
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get("/hangup")
        assert (await client.get("/echo")).status_code == 200  # neither connection was kept
        assert s.connections == 3
    assert s.server is not None
    s.server.close()
    await s.server.wait_closed()
    async with _client(url) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/echo")
    async with httpx.AsyncClient(transport=H11Transport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("ftp://127.0.0.1/")


async def test_a_full_pool_waits_then_times_out(server: tuple[_Server, str]) -> None:
    _, url = server
    async with _client(url, max_connections=1) as client:
        slow = asyncio.create_task(client.get("/slow"))
        await asyncio.sleep(0.2)
        with pytest.raises(httpx.PoolTimeout):
            await client.get("/echo", timeout=httpx.Timeout(5, pool=0.2))
        waiting = asyncio.create_task(client.get("/echo"))  # gets the slot when /slow is done
        assert (await slow).status_code == 200
        assert (await waiting).status_code == 200


async def test_cancelled_request_frees_its_slot(server: tuple[_Server, str]) -> None:
    s, url = server
    async with _client(url, max_connections=1) as client:
        slow = asyncio.create_task(client.get("/slow"))
        await asyncio.sleep(0.2)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert (await client.get("/echo", timeout=httpx.Timeout(5, pool=1))).status_code == 200
        assert s.connections == 2  # the cancelled request's connection was not reused


def _tls_pair(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "capsa test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                    serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    client_ctx = ssl.create_default_context(cafile=str(tmp / "cert.pem"))
    return server_ctx, client_ctx


async def test_https_verifies_with_the_given_context(tmp_path: Path) -> None:
    server_ctx, client_ctx = _tls_pair(tmp_path)
    s = _Server()
    srv = await asyncio.start_server(s.handle, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    try:
        async with _client(url, ssl_context=client_ctx) as client:
            for _ in range(3):
                assert (await client.post("/echo", content=b"secret")).content == b"secret"
        assert s.connections == 1
        async with _client(url) as client:  # the system's CAs do not know this certificate
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get("/echo")
    finally:
        srv.close()
        for w in s.writers:
            w.close()

"""The guest daemon's ``tcp_open``: a TCP connection to a port in the guest relayed over one channel stream.

The daemon runs on the host (LocalGuest), so "a port in the guest" is a server this test runs on the host
loopback; the client is the real GuestClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator

import pytest

from capsa.node.guestlink.client import GuestClient
from capsa.node.guestlink.errors import GuestError
from capsa.node.statuses import status_of
from tests.support.local_guest import guest_client, local_guest

__all__ = ["guest_client", "local_guest"]

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def server(handler: object) -> AsyncIterator[int]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        yield int(srv.sockets[0].getsockname()[1])
    finally:
        srv.close()
        await srv.wait_closed()


async def test_bytes_flow_both_ways_beyond_the_credit_window(guest_client: GuestClient) -> None:
    """16 MiB each way (16 credit windows), the server echoing as it reads: nothing is lost or reordered."""
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()  # after the client's half-close: everything was echoed

    payload = bytes(range(256)) * (64 * 1024)  # 16 MiB
    async with server(echo) as port:
        tunnel = await guest_client.tcp_open(port)

        async def send() -> None:
            for i in range(0, len(payload), 200_000):
                await tunnel.write(payload[i:i + 200_000])
            await tunnel.end()

        sender = asyncio.create_task(send())
        digest, got = hashlib.sha256(), 0
        async for chunk in tunnel.read():
            digest.update(chunk)
            got += len(chunk)
        await sender
    assert got == len(payload) and digest.digest() == hashlib.sha256(payload).digest()
    assert tunnel.bytes_in == len(payload) and tunnel.bytes_out == len(payload)
    assert (await guest_client.health())["pid"]  # the channel is still fine


async def test_closed_port_is_port_unreachable(guest_client: GuestClient) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(GuestError) as failed:
            await guest_client.tcp_open(port)
    assert failed.value.code == "port_unreachable" and status_of(failed.value) == 502
    for bad in (0, 65536):
        with pytest.raises(GuestError) as refused:
            await guest_client.tcp_open(bad)
        assert refused.value.code == "bad_request"


async def test_closing_the_tunnel_closes_the_connection_in_the_guest(guest_client: GuestClient) -> None:
    seen_eof = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        while await reader.read(65536):
            pass
        seen_eof.set()  # the guest closed its socket when the host dropped the tunnel
        writer.close()

    async with server(hold) as port:
        tunnel = await guest_client.tcp_open(port)
        chunks = tunnel.read()
        assert await anext(chunks) == b"hello"
        await tunnel.write(b"ignored")
        await tunnel.close()
        await asyncio.wait_for(seen_eof.wait(), 10)
        await chunks.aclose()

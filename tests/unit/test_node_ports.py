"""The node's port tunnel (``WS /node/v1/sandboxes/{id}/ports/{port}/tunnel``) through the control plane's
NodeClient, the node API served by uvicorn on a Unix socket as in ``capsa serve``: the node token is
required, refusals carry the node's error code, bytes flow both ways with half-close.
"""

from __future__ import annotations

import asyncio

import pytest

from capsa.common.ids import new_id
from capsa.control.nodes.client import NodeClient, NodeError

pytestmark = pytest.mark.timeout(60)

TOKEN = "node-token-0123456789"


async def test_tunnel_needs_the_node_token_and_reports_the_nodes_codes(node_url: str) -> None:
    client = NodeClient(node_url, TOKEN)
    try:
        sid = new_id("sbx")
        await client.create_sandbox(sid, "base", 256, 1, {})

        async def upper(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = await reader.read()  # until the tunnel's half-close
            writer.write(data.upper())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(upper, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            tunnel = await client.open_port(sid, port)
            await tunnel.write(b"through the guest channel")
            await tunnel.end()
            got = b""
            while data := await tunnel.read():
                got += data
            assert got == b"THROUGH THE GUEST CHANNEL"
            await tunnel.aclose()

            wrong = NodeClient(node_url, "another-token-0123456789")
            with pytest.raises(NodeError) as refused:
                await wrong.open_port(sid, port)
            assert refused.value.status == 403  # closed before the upgrade was accepted
            await wrong.aclose()
            with pytest.raises(NodeError) as missing:
                await client.open_port(new_id("sbx"), port)
            assert (missing.value.code, missing.value.status) == ("sandbox_not_found", 404)
        finally:
            server.close()
            await server.wait_closed()
        with pytest.raises(NodeError) as closed:
            await client.open_port(sid, port)
        assert (closed.value.code, closed.value.status) == ("port_unreachable", 502)
    finally:
        await client.aclose()

"""List capsa's MCP tools and use them from the ``mcp`` package's client (``pip install 'capsa[mcp]'``).

    export CAPSA_API_URL=http://127.0.0.1:8700 CAPSA_API_KEY=csk_...
    python examples/mcp_client.py stdio    # spawns `capsa mcp` and talks MCP on its stdin/stdout
    python examples/mcp_client.py http     # the control plane's streamable HTTP endpoint, $CAPSA_API_URL/mcp
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from contextlib import AsyncExitStack
from typing import Any

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client


async def call(client: Client, tool: str, **arguments: Any) -> Any:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise SystemExit(f"{tool}: {result.content[0].text if result.content else 'failed'}")
    data = result.structured_content or {}
    return data.get("result", data)


async def main(transport: str) -> None:
    url = os.environ.get("CAPSA_API_URL", "http://127.0.0.1:8700")
    key = os.environ["CAPSA_API_KEY"]
    async with AsyncExitStack() as stack:
        if transport == "stdio":
            capsa = shutil.which("capsa") or "capsa"
            params = StdioServerParameters(command=capsa, args=["mcp"],
                                           env={"CAPSA_API_URL": url, "CAPSA_API_KEY": key})
            client = await stack.enter_async_context(Client(stdio_client(params)))
        else:
            http = await stack.enter_async_context(httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(30, read=300)))
            client = await stack.enter_async_context(Client(streamable_http_client(f"{url}/mcp",
                                                                                   http_client=http)))
        tools = (await client.list_tools()).tools
        print("tools:", ", ".join(tool.name for tool in tools))
        session = await call(client, "session_create", timeout=600)
        sid = session["id"]
        try:
            ran = await call(client, "command_run", session_id=sid, command="uname -sr; echo $((6 * 7))")
            print(f"command_run: exit {ran['exit_code']}: {ran['stdout'].strip()!r}")
            await call(client, "file_write", session_id=sid, path="/root/mcp-demo/hello.txt",
                       content="hello from MCP\n")
            read = await call(client, "file_read", session_id=sid, path="/root/mcp-demo/hello.txt")
            print(f"file_read: {read['content']!r}")
            listed = await call(client, "file_list", session_id=sid, path="/root/mcp-demo")
            names = [entry["name"] for entry in listed]
            print(f"file_list: {names}")
        finally:
            closed = await call(client, "session_close", session_id=sid)
            print(f"session {sid} is {closed['state']}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("stdio", "http"):
        raise SystemExit("usage: mcp_client.py stdio|http")
    asyncio.run(main(sys.argv[1]))

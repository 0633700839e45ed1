"""An MCP client (the ``mcp`` package's own ``Client``) on capsa's MCP server over each transport, and the
round trip the tests run through it: list the tools, create a session, run a command, write, read and
list a file, close the session."""

from __future__ import annotations

import base64
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

__all__ = ["EXPECTED_TOOLS", "call", "call_error", "http_client", "mcp_round_trip", "stdio_client_for"]

EXPECTED_TOOLS = {"session_create", "session_list", "session_get", "session_close", "session_pause",
                  "session_resume", "session_branch", "command_run", "file_read", "file_write", "file_list"}


@contextlib.asynccontextmanager
async def http_client(api_url: str, key: str | None, *, mode: str = "auto") -> AsyncIterator[Client]:
    """A client on ``<api_url>/mcp`` sending ``key`` as the bearer token. ``mode`` as for ``mcp.Client``:
    ``auto`` (probe the current protocol, fall back to the handshake) or ``legacy`` (the initialize
    handshake that older clients make)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http, \
            Client(streamable_http_client(f"{api_url}/mcp", http_client=http), mode=mode) as client:
        yield client


@contextlib.asynccontextmanager
async def stdio_client_for(api_url: str, key: str, errlog: Path, *,
                           mode: str = "auto") -> AsyncIterator[Client]:
    """``capsa mcp`` spawned as a subprocess (this interpreter's ``capsa`` script) against ``api_url``."""
    capsa = str(Path(sys.executable).with_name("capsa"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSA_")}
    params = StdioServerParameters(command=capsa, args=["mcp"],
                                   env={**env, "CAPSA_API_URL": api_url, "CAPSA_API_KEY": key})
    with errlog.open("w") as err:
        async with Client(stdio_client(params, errlog=err), mode=mode) as client:
            yield client


def _text(result: CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


async def call(client: Client, tool: str, **arguments: Any) -> Any:
    """Call ``tool`` and return its structured result (a list result unwrapped); fail on a tool error."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool} failed: {_text(result)}"
    data = result.structured_content
    assert isinstance(data, dict), result
    return data["result"] if set(data) == {"result"} else data


async def call_error(client: Client, tool: str, **arguments: Any) -> str:
    """Call ``tool`` expecting a tool error; return its text after the ``Error executing tool <name>: ``
    that the ``mcp`` server puts first (capsa's ``<code>: <detail>`` for capsa's errors)."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool} unexpectedly succeeded: {result}"
    text = _text(result)
    prefix = f"Error executing tool {tool}: "
    assert text.startswith(prefix), text
    return text.removeprefix(prefix)


async def mcp_round_trip(client: Client, *, template: str = "base") -> dict[str, Any]:
    """List the tools, then in a new session: run a command, write a file, read it back, list its
    directory; close the session. Returns what the steps answered."""
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == EXPECTED_TOOLS, sorted(tools)
    assert tools["command_run"].input_schema["required"] == ["session_id", "command"]
    assert tools["file_read"].output_schema is not None

    session = await call(client, "session_create", template=template, metadata={"via": "mcp"})
    sid = session["id"]
    try:
        assert session["state"] == "running"
        ran = await call(client, "command_run", session_id=sid, command="echo out; echo err >&2; exit 7")
        outcome = (ran["stdout"], ran["stderr"], ran["exit_code"], ran["timed_out"])
        assert outcome == ("out\n", "err\n", 7, False), ran

        text = "line one\nünïcödé line two\n"
        written = await call(client, "file_write", session_id=sid, path="/tmp/mcp/notes.txt", content=text)
        assert written["size"] == len(text.encode()) and written["type"] == "file"
        read = await call(client, "file_read", session_id=sid, path="/tmp/mcp/notes.txt")
        assert (read["content"], read["encoding"], read["truncated"]) == (text, "utf-8", False)
        head = await call(client, "file_read", session_id=sid, path="/tmp/mcp/notes.txt", max_bytes=4)
        assert (head["content"], head["truncated"]) == ("line", True)

        blob = bytes(range(256))
        await call(client, "file_write", session_id=sid, path="/tmp/mcp/blob.bin",
                   content=base64.b64encode(blob).decode(), encoding="base64")
        back = await call(client, "file_read", session_id=sid, path="/tmp/mcp/blob.bin")
        assert back["encoding"] == "base64" and base64.b64decode(back["content"]) == blob

        listed = await call(client, "file_list", session_id=sid, path="/tmp/mcp")
        assert sorted(e["name"] for e in listed) == ["blob.bin", "notes.txt"]
        seen = await call(client, "command_run", session_id=sid, command="cat /tmp/mcp/notes.txt | wc -l")
        assert seen["stdout"].strip() == "2"

        missing = await call_error(client, "file_read", session_id=sid, path="/tmp/mcp/none")
        assert missing.startswith("not_found:"), missing
        assert sid in [s["id"] for s in await call(client, "session_list")]
    finally:
        closed = await call(client, "session_close", session_id=sid)
    assert closed["state"] == "closed"
    gone = await call_error(client, "command_run", session_id=sid, command="true")
    assert gone.startswith("invalid_state:"), gone
    return {"session": sid, "command": ran, "read": read}

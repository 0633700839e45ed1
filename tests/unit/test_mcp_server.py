"""capsa's MCP server through the ``mcp`` package's client, on the fake runtime's stack: stdio (``capsa
mcp`` spawned against the stack's API) and streamable HTTP (the control plane's ``/mcp``), tool errors,
authentication and tenant isolation, and a missing ``mcp`` package."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from capsa.cli.main import cli
from capsa.control.settings import ControlSettings
from capsa.frontends import build_app
from tests.support.api_stack import ApiStack
from tests.support.mcp_session import (
    EXPECTED_TOOLS,
    call,
    call_error,
    http_client,
    mcp_round_trip,
    stdio_client_for,
)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_round_trip_over_http(stack: ApiStack, mode: str) -> None:
    key = await stack.tenant_key("mcp-http")
    async with http_client(stack.url, key, mode=mode) as client:
        done = await mcp_round_trip(client)
    assert done["command"]["exit_code"] == 7


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_round_trip_over_stdio(stack: ApiStack, tmp_path: Path, mode: str) -> None:
    key = await stack.tenant_key("mcp-stdio")
    async with stdio_client_for(stack.url, key, tmp_path / "mcp.err", mode=mode) as client:
        await mcp_round_trip(client)
        # a bad argument is refused by the tool's schema, and the server keeps serving
        bad = await call_error(client, "command_run", session_id="ses_x", command="true", timeout=-1)
        assert "timeout" in bad
        assert await call(client, "session_list", state="running") == []


async def test_stdio_with_a_wrong_key_reports_unauthorized(stack: ApiStack, tmp_path: Path) -> None:
    async with stdio_client_for(stack.url, "csk_000000000000_" + "0" * 32, tmp_path / "mcp.err") as client:
        text = await call_error(client, "session_list")
    assert text.startswith("unauthorized:"), text


async def test_stdio_with_the_api_down_reports_unreachable(tmp_path: Path) -> None:
    async with stdio_client_for("http://127.0.0.1:9", "csk_000000000000_" + "0" * 32,
                                tmp_path / "mcp.err") as client:
        text = await call_error(client, "session_get", session_id="ses_x")
    assert text.startswith("unreachable:"), text


async def test_http_needs_a_valid_key(stack: ApiStack) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for key in (None, "csk_000000000000_" + "0" * 32, "not-a-key"):
        async with stack.client(key) as client:
            response = await client.post("/mcp", json=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    # with a key, the same bare JSON-RPC request (what docs/integrations.md shows with curl) is answered
    async with stack.client(await stack.tenant_key("curl")) as client:
        response = await client.post("/mcp", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert {t["name"] for t in response.json()["result"]["tools"]} == EXPECTED_TOOLS


async def test_http_tools_act_as_the_callers_tenant_only(stack: ApiStack) -> None:
    alice, bob = await stack.tenant_key("alice"), await stack.tenant_key("bob")
    async with http_client(stack.url, alice) as a, http_client(stack.url, bob) as b:
        session = await call(a, "session_create")
        sid = session["id"]
        assert session["tenant"] == "alice"
        await call(a, "file_write", session_id=sid, path="/tmp/secret.txt", content="alice's")
        for tool, args in (("session_get", {}), ("command_run", {"command": "cat /tmp/secret.txt"}),
                           ("file_read", {"path": "/tmp/secret.txt"}), ("file_list", {"path": "/tmp"}),
                           ("file_write", {"path": "/tmp/x", "content": "y"}), ("session_pause", {}),
                           ("session_branch", {}), ("session_close", {})):
            text = await call_error(b, tool, session_id=sid, **args)
            assert text.startswith("not_found:"), (tool, text)
        assert await call(b, "session_list") == []
        assert [s["id"] for s in await call(a, "session_list")] == [sid]
        # alice's session is untouched by bob's attempts
        assert (await call(a, "file_read", session_id=sid, path="/tmp/secret.txt"))["content"] == "alice's"
        assert (await call(a, "session_close", session_id=sid))["state"] == "closed"


async def test_pause_resume_and_branch_through_mcp(stack: ApiStack) -> None:
    key = await stack.tenant_key("mcp-snap")
    async with http_client(stack.url, key) as client:
        sid = (await call(client, "session_create"))["id"]
        await call(client, "file_write", session_id=sid, path="/tmp/state.txt", content="kept")
        assert (await call(client, "session_pause", session_id=sid))["state"] == "paused"
        busy = await call_error(client, "command_run", session_id=sid, command="true")
        assert busy.startswith("invalid_state:"), busy
        assert (await call(client, "session_resume", session_id=sid))["state"] == "running"
        assert (await call(client, "file_read", session_id=sid, path="/tmp/state.txt"))["content"] == "kept"
        branches = await call(client, "session_branch", session_id=sid, n=2)
        assert len(branches) == 2 and all(b["metadata"]["branched_from"] == sid for b in branches)
        for branch in branches:
            got = await call(client, "file_read", session_id=branch["id"], path="/tmp/state.txt")
            assert got["content"] == "kept"
            await call(client, "session_close", session_id=branch["id"])
        await call(client, "session_close", session_id=sid)


def test_capsa_mcp_without_the_package_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an install without capsa[mcp] looks like
    result = CliRunner().invoke(cli, ["mcp"])
    assert result.exit_code == 1
    assert result.stderr == "error: the MCP server needs the mcp package: pip install 'capsa[mcp]'\n"


async def test_control_plane_without_the_package_answers_501(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)
    app = build_app(ControlSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        # No body: a body would first meet the request guard's credential check (the app is not started
        # here, so it answers not_ready), and what is under test is the route without the package.
        response = await client.post("/mcp")
    assert response.status_code == 501
    assert response.json()["code"] == "mcp_unavailable" and "capsa[mcp]" in response.json()["detail"]


def test_capsa_mcp_with_an_unusable_key_is_a_one_line_error() -> None:
    result = CliRunner().invoke(cli, ["mcp", "--api-key", "bad key"], input="")
    assert result.exit_code == 1
    assert result.stderr == "error: the API key contains characters that cannot be sent in a header\n"


async def test_http_refuses_a_request_over_the_transport_limit_and_keeps_serving(stack: ApiStack) -> None:
    key = await stack.tenant_key("mcp-big")
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "file_write", "arguments": {"session_id": "ses_x", "path": "/tmp/big",
                                                           "content": "a" * (5 * 1024 * 1024)}}}
    headers = {"Accept": "application/json, text/event-stream"}
    async with stack.client(key) as client:
        response = await client.post("/mcp", json=body, headers=headers)
        assert response.status_code == 413, response.text
        small = {**body, "params": {**body["params"], "arguments": {**body["params"]["arguments"],
                                                                     "content": "a"}}}
        response = await client.post("/mcp", json=small, headers=headers)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert result["isError"] and "not_found:" in result["content"][0]["text"]


async def test_session_create_takes_an_egress_policy_with_its_schema(stack: ApiStack) -> None:
    key = await stack.tenant_key("mcp-policy")
    async with http_client(stack.url, key) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        schema = tools["session_create"].input_schema
        assert "DomainRule" in schema["$defs"] and "policy" in schema["properties"]
        bad = await call_error(client, "session_create", policy={"domains": [{"domain": "not a domain"}]})
        assert "domain" in bad
        # the policy reaches the node, which has no egress service here: capsa's error, with its code
        refused = await call_error(client, "session_create", policy={"domains": [{"domain": "pypi.org"}]})
        assert refused.startswith("session_failed:") and "no egress service" in refused, refused

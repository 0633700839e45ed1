"""The agent-framework integrations against a real ``capsa serve`` with real microVMs: the LangChain
deepagents backend (its methods, and a deep agent's own tools driven by a scripted list of tool calls:
no model call), and the MCP server through the ``mcp`` client over stdio (``capsa mcp``) and over
streamable HTTP (``/mcp``), including another tenant's key over HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsa.integrations.langchain import CapsaSandbox
from capsa.sdk import AsyncClient, AsyncCommands
from tests.support.deepagents_workflow import (
    arun_deepagents_agent,
    run_deepagents_agent,
    run_deepagents_workflow,
)
from tests.support.mcp_session import call, call_error, http_client, mcp_round_trip, stdio_client_for
from tests.support.served import ROOT, Served, capsa

pytestmark = pytest.mark.vm


def _tenant_key(served: Served, admin: str, tenant: str) -> str:
    made = capsa(served, admin, "keys", "create", "--tenant", tenant)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_deepagents_backend_runs_a_multi_step_workflow_in_a_vm(server: tuple[Served, str]) -> None:
    served, admin = server
    key = _tenant_key(served, admin, "deepagents-vm")
    with CapsaSandbox.create(api_url=served.url, api_key=key) as backend:
        # it runs in the VM: the guest's hostname is made from its sandbox id (sbx-…)
        hostname = backend.execute("cat /proc/sys/kernel/hostname").output.strip()
        assert hostname.startswith("sbx-"), hostname
        started = time.monotonic()
        run_deepagents_workflow(backend, "/root/work")
        direct = time.monotonic() - started
        started = time.monotonic()
        tools = run_deepagents_agent(backend, "/root/agent")
        agent = time.monotonic() - started
        print(f"deepagents workflow: direct {direct:.1f} s, agent (7 tool calls) {agent:.1f} s; "
              f"agent's execute said {tools[1].content!r}")
        assert backend.execute("cat /root/agent/result.txt").output.strip() == "42"
    assert backend.session.state == "closed"


async def test_deepagents_agent_through_ainvoke_in_a_vm(server: tuple[Served, str]) -> None:
    served, admin = server
    key = await asyncio.to_thread(_tenant_key, served, admin, "deepagents-async-vm")
    async with await CapsaSandbox.acreate(api_url=served.url, api_key=key) as backend:
        tools = await arun_deepagents_agent(backend, "/root/agent-async")
        assert (await backend.aexecute("cat /root/agent-async/result.txt")).output == "42\n"
    assert len(tools) == 7 and backend.session.state == "closed"


async def test_mcp_round_trip_over_stdio_in_a_vm(server: tuple[Served, str], tmp_path: Path) -> None:
    served, admin = server
    key = await asyncio.to_thread(_tenant_key, served, admin, "mcp-stdio-vm")
    async with stdio_client_for(served.url, key, tmp_path / "mcp.err") as client:
        done = await mcp_round_trip(client)
    print(f"mcp stdio round trip in {done['session']}: {done['command']}")


async def test_mcp_round_trip_over_http_and_tenant_isolation_in_a_vm(server: tuple[Served, str]) -> None:
    served, admin = server
    alice = await asyncio.to_thread(_tenant_key, served, admin, "mcp-alice")
    bob = await asyncio.to_thread(_tenant_key, served, admin, "mcp-bob")
    async with http_client(served.url, alice) as a, http_client(served.url, bob) as b:
        done = await mcp_round_trip(a)
        print(f"mcp http round trip in {done['session']}: {done['command']}")
        sid = (await call(a, "session_create"))["id"]
        try:
            kernel = await call(a, "command_run", session_id=sid, command="uname -r; echo private > /root/p")
            assert kernel["exit_code"] == 0
            refused = (("command_run", {"command": "cat /root/p"}), ("file_read", {"path": "/root/p"}),
                       ("session_get", {}), ("session_close", {}))
            for tool, args in refused:
                text = await call_error(b, tool, session_id=sid, **args)
                assert text.startswith("not_found:"), (tool, text)
            assert sid not in [s["id"] for s in await call(b, "session_list")]
            assert (await call(a, "file_read", session_id=sid, path="/root/p"))["content"] == "private\n"

            # what MCP over HTTP adds to a command: `true` through the tool vs through the SDK, p50 of 10
            via_mcp, via_sdk = [], []
            async with AsyncClient(served.url, alice) as sdk:
                commands = AsyncCommands(sdk, sid)
                for _ in range(10):
                    started = time.monotonic()
                    await call(a, "command_run", session_id=sid, command="true")
                    via_mcp.append(time.monotonic() - started)
                    started = time.monotonic()
                    await commands.run("true")
                    via_sdk.append(time.monotonic() - started)
            print(f"command `true` p50: MCP over HTTP {statistics.median(via_mcp) * 1000:.0f} ms, "
                  f"SDK {statistics.median(via_sdk) * 1000:.0f} ms")
        finally:
            await call(a, "session_close", session_id=sid)


def test_the_documented_examples_run(server: tuple[Served, str]) -> None:
    """examples/deepagents_sandbox.py and examples/mcp_client.py (docs/integrations.md), as written."""
    served, admin = server
    key = _tenant_key(served, admin, "examples")
    bin_dir = str(Path(sys.executable).parent)  # where `capsa` is, as after `pip install`
    env = {**os.environ, "CAPSA_API_URL": served.url, "CAPSA_API_KEY": key,
           "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    env.pop("MODEL", None)
    runs = {name: subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True,
                                 text=True, env=env, timeout=600, cwd=ROOT)
            for name, args in (("deepagents_sandbox.py", []), ("mcp_client.py", ["stdio"]))}
    http = subprocess.run([sys.executable, str(ROOT / "examples" / "mcp_client.py"), "http"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    for run in (*runs.values(), http):
        assert run.returncode == 0, run.stdout + run.stderr
    agent = runs["deepagents_sandbox.py"].stdout
    assert "execute: exit 0: 0 1 1 2 3 5 8 13 21 34\n" in agent, agent
    assert "execute: 0 1 1 2 3 5 8 13 21 34 55 89\n" in agent, agent
    assert "grep: [('/root/fib.py', 2)]" in agent, agent
    for out in (runs["mcp_client.py"].stdout, http.stdout):
        assert "tools: session_create, " in out and "command_run: exit 0: 'Linux " in out and "\\n42'" in out
        assert "file_read: 'hello from MCP\\n'" in out and "file_list: ['hello.txt']" in out, out
        assert re.search(r"session ses_\w+ is closed", out), out

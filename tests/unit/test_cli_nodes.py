"""``capsa nodes token|ls`` as subprocesses against a real control plane (the in-process stack on 127.0.0.1).

The JSON shapes are a contract used by checks outside this suite: ``{"token": ...}`` and
``{"items": [{"id", "url", "healthy", "capacity", "used", ...}]}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest

from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.postgresql

_CLI = "from capsa.cli.main import main; main()"


async def capsa(stack: ApiStack, *args: str, key: str | None = None) -> tuple[int, str, str]:
    env = {**os.environ, "CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key or stack.admin_key}
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _CLI, *args, env=env, stdout=pipe,
                                                stderr=pipe)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_nodes_token_json_gives_a_token_that_enrols_once(stack: ApiStack) -> None:
    code, out, err = await capsa(stack, "nodes", "token", "--json")
    assert code == 0, err
    made: dict[str, Any] = json.loads(out)
    assert isinstance(made["token"], str) and made["token"]
    body = {"url": "http://127.0.0.1:9", "api_token": "t" * 20,
            "capacity": {"memory_mib": 1024, "vcpus": 2, "max_sandboxes": 2}}
    async with stack.client(made["token"]) as node:
        assert (await node.post("/v1/nodes/enrol", json=body)).status_code == 201
        assert (await node.post("/v1/nodes/enrol", json=body)).status_code == 401
    # Without --json the token alone is on stdout, so `T=$(capsa nodes token)` works.
    code, out, err = await capsa(stack, "nodes", "token", "--ttl", "600")
    assert code == 0 and out.strip().startswith("cne_") and len(out.strip().splitlines()) == 1, err


async def test_nodes_ls_json_and_table(stack: ApiStack) -> None:
    code, out, err = await capsa(stack, "nodes", "ls", "--json")
    assert code == 0, err
    items = json.loads(out)["items"]
    assert [n["id"] for n in items] == [stack.node_id]
    node = items[0]
    assert node["url"].startswith("unix://") and node["healthy"] is True
    assert node["capacity"] == {"memory_mib": 8192, "vcpus": 32, "max_sandboxes": 16}
    assert isinstance(node["used"], dict)
    code, out, err = await capsa(stack, "nodes", "ls")
    assert code == 0, err
    assert "HEALTHY" in out and stack.node_id in out and "yes" in out


async def test_nodes_commands_need_an_admin_key(stack: ApiStack) -> None:
    user = await stack.tenant_key("t1")
    for args in (("nodes", "token", "--json"), ("nodes", "ls", "--json")):
        code, out, err = await capsa(stack, *args, key=user)
        assert code != 0 and out == ""
        assert len(err.strip().splitlines()) == 1 and "admin" in err, err

"""Issue 27 (low): E2B's ``envdAccessToken`` is a per-sandbox token, not the caller's API key. Against the
real control plane and node agent (fake runtime, real HTTP) with the stock ``e2b`` SDK: the SDK works with
the token it is handed; that token is refused on ``/v1``, on E2B's REST API and on another sandbox's envd (of
the same tenant), and dies with its API key.
"""

from __future__ import annotations

import httpx
import pytest
from e2b import AsyncSandbox

from capsa.sdk.config import ClientConfig
from capsa.sdk.e2b import e2b_environment
from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.timeout(300)


async def test_the_envd_token_reaches_only_its_own_sandbox(stack: ApiStack,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    key = await stack.tenant_key("envd-tokens")
    env = e2b_environment(ClientConfig.resolve(stack.url, key))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mine, other = await AsyncSandbox.create(), await AsyncSandbox.create()
    try:
        async with httpx.AsyncClient(base_url=env["E2B_API_URL"], headers={"X-API-KEY": key}) as rest:
            detail = (await rest.get(f"/sandboxes/{mine.sandbox_id}")).json()
        token = detail["envdAccessToken"]
        assert token != key and key.split("_")[2] not in token
        # The stock SDK, handed that token, works: commands and files (envd RPCs and /files).
        assert (await mine.commands.run("echo scoped")).stdout == "scoped\n"
        await mine.files.write("/tmp/scoped.txt", "mine")
        assert await mine.files.read("/tmp/scoped.txt") == "mine"

        async with httpx.AsyncClient(base_url=stack.url) as client:
            v1 = await client.get("/v1/sessions", headers={"Authorization": f"Bearer {token}"})
            assert v1.status_code == 401, v1.text
            as_rest_key = await client.get(f"{env['E2B_API_URL']}/sandboxes", headers={"X-API-KEY": token})
            assert as_rest_key.status_code == 401, as_rest_key.text
        async with httpx.AsyncClient(base_url=env["E2B_SANDBOX_URL"]) as envd:

            async def list_processes(sandbox_id: str, credential: str) -> int:
                r = await envd.post("/process.Process/List", json={}, headers={
                    "X-Access-Token": credential, "E2b-Sandbox-Id": sandbox_id})
                return r.status_code

            async def read_hostname(sandbox_id: str, credential: str) -> int:
                r = await envd.get("/files", params={"path": "/etc/hostname"}, headers={
                    "X-Access-Token": credential, "E2b-Sandbox-Id": sandbox_id})
                return r.status_code

            assert await list_processes(mine.sandbox_id, token) == 200
            assert await list_processes(other.sandbox_id, token) == 401  # same tenant, other sandbox
            assert await read_hostname(other.sandbox_id, token) == 401
            assert await list_processes(other.sandbox_id, token[:-2] + "AA") == 401
            async with stack.client(stack.admin_key) as admin:  # revoking the key ends its tokens
                key_id = "_".join(key.split("_")[:2])
                assert (await admin.delete(f"/v1/keys/{key_id}")).status_code == 200
            assert await list_processes(mine.sandbox_id, token) == 401
    finally:
        async with stack.client(stack.admin_key) as admin:
            for sbx in (mine, other):
                await admin.delete(f"/v1/sessions/{sbx.sandbox_id}")

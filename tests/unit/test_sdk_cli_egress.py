"""SDK (``client.secrets``, ``session.egress``, ``s.audit()``) and CLI (``capsa secrets``, ``capsa audit``,
``capsa policy``) against the real API stack with the fake runtime. The CLI runs in a thread: its blocking
SDK needs the stack's event loop (this test's) to keep serving."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from capsa.cli.main import cli
from capsa.sdk import AsyncClient, AsyncSession, InvalidState, NotFound, Unavailable, ValidationFailed
from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.timeout(120)

VALUE = "tok-" + os.urandom(10).hex()


async def _cli(stack: ApiStack, key: str, *args: str, stdin: str | None = None) -> Result:
    env = {"CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), input=stdin, env=env)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/capsa.db"


async def test_sdk_secrets_policy_and_audit(make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await make_stack(settings={"secret_key": base64.b64encode(os.urandom(32)).decode()})
    key = await stack.tenant_key("acme")
    async with AsyncClient(stack.url, key) as client:
        info = await client.secrets.create("gh", VALUE, description="token")
        assert info.name == "gh" and info.id.startswith("sec_")
        assert [s.id for s in await client.secrets.list()] == [info.id]
        with pytest.raises(ValidationFailed):
            await AsyncSession.create(client=client, policy={"domains": [{"domain": "10.1.1.1"}]})
        async with await AsyncSession.create(client=client) as s:
            assert (await s.egress.policy()).policy is None
            assert await s.audit() == []
            with pytest.raises(InvalidState):
                await s.set_policy({"domains": [{"domain": "a.example.com"}]})
        await client.secrets.delete("gh")
        with pytest.raises(NotFound):
            await client.secrets.delete(info.id)


async def test_secrets_unavailable_is_a_typed_error(make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await make_stack()
    async with AsyncClient(stack.url, await stack.tenant_key("acme")) as client:
        with pytest.raises(Unavailable):
            await client.secrets.create("x", "y")


async def test_cli_secrets_audit_policy(make_stack: Callable[..., Awaitable[ApiStack]]) -> None:
    stack = await make_stack(settings={"secret_key": base64.b64encode(os.urandom(32)).decode()})
    key = await stack.tenant_key("acme")
    created = await _cli(stack, key, "secrets", "create", "openai", "--description", "d", stdin=VALUE + "\n")
    assert created.exit_code == 0, created.output
    sec_id = created.stdout.strip()
    assert sec_id.startswith("sec_") and VALUE not in created.output
    listed = await _cli(stack, key, "secrets", "ls", "--json")
    assert [s["name"] for s in json.loads(listed.stdout)["items"]] == ["openai"]
    assert VALUE not in listed.output
    table = await _cli(stack, key, "secrets", "ls")
    assert "openai" in table.stdout and sec_id in table.stdout
    dup = await _cli(stack, key, "secrets", "create", "openai", stdin="x\n")
    assert dup.exit_code == 1 and "already_exists" in dup.output
    empty = await _cli(stack, key, "secrets", "create", "blank", stdin="\n")
    assert empty.exit_code == 1 and "empty" in empty.output
    os.environ["CAPSA_TEST_SECRET_VALUE"] = VALUE
    try:
        from_env = await _cli(stack, key, "secrets", "create", "env-one", "--from-env",
                              "CAPSA_TEST_SECRET_VALUE")
    finally:
        del os.environ["CAPSA_TEST_SECRET_VALUE"]
    assert from_env.exit_code == 0, from_env.output
    assert (await _cli(stack, key, "secrets", "rm", "openai", "env-one")).exit_code == 0
    assert json.loads((await _cli(stack, key, "secrets", "ls", "--json")).stdout)["items"] == []

    async with AsyncClient(stack.url, key) as client:
        sid = (await client.create_session()).id
    audit = await _cli(stack, key, "audit", sid, "--json")
    assert audit.exit_code == 0 and json.loads(audit.stdout) == {"items": []}
    shown = await _cli(stack, key, "policy", "show", sid)
    assert "no network" in shown.stdout
    missing = await _cli(stack, key, "audit", "ses_00000000000000000000")
    assert missing.exit_code == 1 and "not_found" in missing.output
    refused = await _cli(stack, key, "policy", "set", sid, "-", stdin="domains: [{domain: a.example.com}]\n")
    assert refused.exit_code == 1 and "no_network" in refused.output
    bad = await _cli(stack, key, "policy", "set", sid, "-", stdin="[1, 2]\n")
    assert bad.exit_code == 1 and "mapping" in bad.output


async def test_cli_run_with_policy_file(make_stack: Callable[..., Awaitable[ApiStack]],
                                        tmp_path: Path) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    bad = tmp_path / "bad.yaml"
    bad.write_text("domains: [{domain: 10.0.0.1}]\n")
    refused = await _cli(stack, key, "run", "--policy", str(bad), "--", "true")
    assert refused.exit_code != 0 and "validation_error" in refused.output
    listed = await _cli(stack, key, "ls", "--json")
    assert json.loads(listed.stdout)["items"] == []  # a refused policy creates nothing
    not_a_map = tmp_path / "list.yaml"
    not_a_map.write_text("- a\n")
    assert "mapping" in (await _cli(stack, key, "run", "--policy", str(not_a_map), "--", "true")).output

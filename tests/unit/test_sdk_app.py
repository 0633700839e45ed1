"""The SDK and the CLI against the real server stack (control plane + node agent over HTTP, SQLite).

The sandboxes here are real guest daemons running as confined host processes (tests/support/fake_runtime.py:
private /tmp, user nobody), so these run in seconds; the same user journeys against real microVMs are in
tests/integration/test_sdk_vm.py and test_cli_serve.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from capsa.cli.main import cli
from capsa.sdk import (
    AsyncClient,
    AsyncSession,
    Client,
    Forbidden,
    InvalidState,
    NotFound,
    RateLimited,
    Session,
    TemplateNotFound,
    Unauthorized,
    ValidationFailed,
)
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ApiStack]:
    runtime = FakeRuntime()
    db = f"sqlite+aiosqlite:///{tmp_path}/capsa.db"
    async with ApiStack(db, runtime, fake_image(tmp_path / "img")) as s:
        yield s


@pytest.fixture
async def tenant(stack: ApiStack) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(stack.url, await stack.tenant_key("acme")) as client:
        yield client


async def test_session_commands_and_files_round_trip(tenant: AsyncClient, tmp_path: Path) -> None:
    work = Path("/tmp/work")  # inside the sandbox
    async with await AsyncSession.create(client=tenant, env={"GREETING": "hi"}, timeout=300) as s:
        assert s.state == "running" and s.info.tenant == "acme"

        res = await s.commands.run(["python3", "-c", "import os,sys; print(os.environ['GREETING']); "
                                    "print('e', file=sys.stderr); sys.exit(3)"])
        assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, "hi\n", "e\n", False)

        chunks: list[tuple[str, str]] = []
        res = await s.commands.run("for i in 1 2 3; do echo $i; done; echo err >&2", env={"X": "1"},
                                   on_stdout=lambda d: chunks.append(("out", d)),
                                   on_stderr=lambda d: chunks.append(("err", d)))
        assert res.exit_code == 0 and res.stdout == "1\n2\n3\n" and res.stderr == "err\n"
        assert "".join(d for k, d in chunks if k == "out") == "1\n2\n3\n"

        res = await s.commands.run("cat; pwd", stdin="from stdin\n", cwd="/tmp")
        assert res.stdout == "from stdin\n/tmp\n"

        res = await s.commands.run("sleep 5", timeout=0.5)
        assert res.timed_out and res.exit_code != 0

        await s.files.mkdir(str(work / "sub"))
        blob = os.urandom(3 * 1024 * 1024 + 17)
        info = await s.files.write(str(work / "sub" / "blob.bin"), blob, mode=0o600)
        assert (info.size, info.mode, info.type) == (len(blob), 0o600, "file")
        assert await s.files.read_bytes(str(work / "sub" / "blob.bin")) == blob
        await s.files.write(str(work / "empty"), b"")
        assert await s.files.read_bytes(str(work / "empty")) == b""

        local = tmp_path / "local.bin"
        await asyncio.to_thread(local.write_bytes, blob)
        await s.files.upload(str(work / "up.bin"), local)
        down = tmp_path / "down.bin"
        assert await s.files.download(str(work / "up.bin"), down) == len(blob)
        downloaded = await asyncio.to_thread(down.read_bytes)
        assert hashlib.sha256(downloaded).digest() == hashlib.sha256(blob).digest()

        names = sorted(f.name for f in await s.files.list(str(work)))
        assert names == ["empty", "sub", "up.bin"]
        assert (await s.files.stat(str(work / "sub"))).is_dir
        await s.files.remove(str(work / "sub"), recursive=True)
        assert not await s.files.exists(str(work / "sub"))
        with pytest.raises(NotFound):
            await s.files.read(str(work / "missing"))
        with pytest.raises(ValidationFailed) as bad:
            await s.files.read("relative/path")
        assert bad.value.errors and "path" in bad.value.errors[0].field

        proc = await s.commands.run("echo started; sleep 30", background=True)
        assert proc.info.running
        assert proc.pid in [p.pid for p in await s.commands.list()]
        for _ in range(200):  # its output is readable while it runs
            if (await proc.output()).stdout == "started\n":
                break
            await asyncio.sleep(0.05)
        assert (await proc.output()).running
        await proc.kill(9)
        out = await proc.wait(10, poll_interval=0.05)
        assert not out.running and out.signal == 9 and out.stdout == "started\n"
        quick = await s.commands.run(["sh", "-c", "echo done"], background=True)
        assert (await quick.wait(10, poll_interval=0.05)).stdout == "done\n"
    assert s.state == "closed"
    with pytest.raises(InvalidState):
        await AsyncSession(s.info, tenant).commands.run("true")


async def test_metadata_list_connect_and_timeout(tenant: AsyncClient) -> None:
    s1 = await AsyncSession.create(client=tenant, metadata={"team": "red"})
    s2 = await AsyncSession.create(client=tenant, metadata={"team": "blue"})
    try:
        red = await AsyncSession.list(client=tenant, metadata={"team": "red"})
        assert [s.id for s in red] == [s1.id]
        running = {s.id for s in await tenant.list_sessions(state="running")}
        assert {s1.id, s2.id} <= running
        paged = [s.id async for s in tenant.iter_sessions(page_size=1)]
        assert {s1.id, s2.id} <= set(paged) and len(paged) == len(set(paged))
        again = await AsyncSession.connect(s1.id, client=tenant)
        before = again.info.expires_at
        after = (await again.set_timeout(7200)).expires_at
        assert before is not None and after is not None and after > before
    finally:
        await s1.close()
        await s2.close()
    closed = await AsyncSession.list(client=tenant, state="closed")
    assert {s1.id, s2.id} <= {s.id for s in closed}


async def test_errors_from_the_real_server(stack: ApiStack, tenant: AsyncClient) -> None:
    with pytest.raises(TemplateNotFound):
        await AsyncSession.create("no-such-template", client=tenant)
    with pytest.raises(ValidationFailed) as invalid:
        await AsyncSession.create(client=tenant, timeout=0)
    assert any(e.field.endswith("timeout") for e in invalid.value.errors)
    with pytest.raises(NotFound):
        await AsyncSession.connect("ses_doesnotexist00000000", client=tenant)
    with pytest.raises(Forbidden):
        await tenant.keys.create("other")
    async with AsyncClient(stack.url, "csk_wrongwrongwr_" + "x" * 32) as wrong:
        with pytest.raises(Unauthorized):
            await AsyncSession.list(client=wrong)
    async with AsyncClient(stack.url, None) as anonymous:
        with pytest.raises(Unauthorized):
            await AsyncSession.list(client=anonymous)
        assert (await anonymous.health())["status"] == "ok"

    # Another tenant's session does not exist as far as this tenant can tell.
    async with AsyncClient(stack.url, await stack.tenant_key("other")) as other:
        theirs = await AsyncSession.create(client=other)
        try:
            with pytest.raises(NotFound):
                await AsyncSession.connect(theirs.id, client=tenant)
            with pytest.raises(NotFound):
                await AsyncSession(theirs.info, tenant).close()
        finally:
            await theirs.close()


async def test_keys_management_and_revocation(stack: ApiStack) -> None:
    async with AsyncClient(stack.url, stack.admin_key) as admin:
        key = await admin.keys.create("team", name="ci")
        assert key.key and key.key.startswith(key.id + "_") and key.tenant == "team" and not key.admin
        listed = {k.id: k for k in await admin.keys.list()}
        assert listed[key.id].key is None  # the secret is never listed
        async with AsyncClient(stack.url, key.key) as user:
            assert await AsyncSession.list(client=user) == []
            revoked = await admin.keys.revoke(key.id)
            assert revoked.revoked_at is not None
            with pytest.raises(Unauthorized):
                await AsyncSession.list(client=user)


async def test_blocking_session_against_the_server(stack: ApiStack) -> None:
    key = await stack.tenant_key("blocking")

    def journey() -> tuple[str, str, str]:
        with Client(stack.url, key) as client, Session.create(client=client) as s:
            seen: list[str] = []
            res = s.commands.run("echo one; echo two", on_stdout=seen.append)
            s.files.write("/tmp/f.txt", "content")
            text = s.files.read("/tmp/f.txt")
            assert [i.id for i in Session.list(client=client)] == [s.id]
            return res.stdout, "".join(seen), text

    assert await asyncio.to_thread(journey) == ("one\ntwo\n", "one\ntwo\n", "content")


def _cli(stack: ApiStack, key: str, *args: str, stdin: str | None = None) -> Result:
    env = {"CAPSA_API_URL": stack.url, "CAPSA_API_KEY": key}
    return CliRunner().invoke(cli, list(args), env=env, input=stdin, catch_exceptions=False)


async def test_cli_against_the_server(stack: ApiStack) -> None:
    admin = stack.admin_key

    async def cli_(*args: str, key: str = admin, stdin: str | None = None) -> Result:
        # The server runs on this event loop, so the blocking CLI must run on another thread.
        return await asyncio.to_thread(_cli, stack, key, *args, stdin=stdin)

    created = await cli_("keys", "create", "--tenant", "cli", "--json")
    assert created.exit_code == 0, created.output
    key = json.loads(created.stdout)["key"]

    run = await cli_("run", "--", "sh", "-c", "echo out; echo err >&2; exit 7", key=key)
    assert (run.exit_code, run.stdout, run.stderr) == (7, "out\n", "err\n")
    piped = await cli_("run", "-i", "--", "tr a-z A-Z", key=key, stdin="shout\n")
    assert (piped.exit_code, piped.stdout) == (0, "SHOUT\n")

    async with AsyncClient(stack.url, key) as client:
        assert await client.list_sessions(state="running") == []  # `capsa run` closed its sessions
        s = await AsyncSession.create(client=client, metadata={"who": "cli"})
    try:
        ex = await cli_("exec", s.id, "--json", "--", "python3", "-c", "print(6*7)", key=key)
        data: dict[str, Any] = json.loads(ex.stdout)
        assert ex.exit_code == 0 and data["stdout"] == "42\n" and data["session_id"] == s.id
        listing = await cli_("ls", "--state", "running", key=key)
        assert s.id in listing.stdout and "who=cli" in listing.stdout
        assert json.loads((await cli_("ls", "--json", key=key)).stdout)["items"][0]["id"] == s.id
        other = await cli_("exec", s.id, "--", "true", key=await stack.tenant_key("intruder"))
        assert other.exit_code == 125 and other.stderr.startswith("error: not_found")
    finally:
        closed = await cli_("close", s.id, key=key)
    assert closed.exit_code == 0 and closed.stdout == f"{s.id} closed\n"
    after = await cli_("exec", s.id, "--", "true", key=key)
    assert after.exit_code == 125 and after.stderr.startswith("error: invalid_state")

    keys_ls = await cli_("keys", "ls", "--json")
    ids = [k["id"] for k in json.loads(keys_ls.stdout)["items"]]
    key_id = key.rsplit("_", 1)[0]
    assert key_id in ids
    assert (await cli_("keys", "revoke", key_id)).exit_code == 0
    denied = await cli_("ls", key=key)
    assert denied.exit_code == 1 and denied.stderr.startswith("error: unauthorized")


@pytest.mark.usefixtures("pinned_rate_window")
async def test_rate_limit_surfaces_with_retry_after(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/limited.db"
    limits = {"session_create_limit": 1, "command_limit": 2, "rate_window_seconds": 60}
    async with ApiStack(db, FakeRuntime(), fake_image(tmp_path / "img"), settings=limits) as limited, \
            AsyncClient(limited.url, await limited.tenant_key("busy")) as client:
        s = await AsyncSession.create(client=client)
        try:
            with pytest.raises(RateLimited) as too_many:
                await AsyncSession.create(client=client)
            assert too_many.value.retry_after is not None and 0 < too_many.value.retry_after <= 60
            await s.commands.run("true")
            await s.commands.run("true")
            with pytest.raises(RateLimited):
                await s.commands.run("true", on_stdout=lambda d: None)  # the streaming path too
        finally:
            await s.close()

"""The stock ``e2b`` SDK (async), configured only by the environment ``capsa e2b env`` prints, against the
real control plane and node agent (fake runtime: guest daemons as host processes). The same calls in real
microVMs: tests/integration/test_e2b_vm.py."""

from __future__ import annotations

import asyncio
import io
import json
import struct
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from e2b import (
    AsyncSandbox,
    NotFoundException,
    PtySize,
    RateLimitException,
    SandboxException,
    TimeoutException,
)
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from capsa.cli.main import cli
from capsa.sdk.config import ClientConfig
from capsa.sdk.e2b import e2b_environment
from tests.support.api_stack import ApiStack


def _point_sdk_at(monkeypatch: pytest.MonkeyPatch, stack: ApiStack, key: str) -> dict[str, str]:
    env = e2b_environment(ClientConfig.resolve(stack.url, key))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


async def _eventually(check: object, within: float = 15.0) -> None:
    assert callable(check)
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_stock_sdk_commands_files_pty_watch(stack: ApiStack, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-a"))
    sbx = await AsyncSandbox.create(timeout=120, metadata={"purpose": "test"}, envs={"GREETING": "hej"})
    try:
        assert sbx.sandbox_id.startswith("ses_")
        r = await sbx.commands.run("echo $GREETING; echo oops >&2; exit 0")
        assert (r.stdout, r.stderr, r.exit_code) == ("hej\n", "oops\n", 0)

        streamed: list[str] = []
        bg = await sbx.commands.run("for i in 1 2 3; do echo l$i; sleep 0.1; done; sleep 60", background=True,
                                    on_stdout=streamed.append)
        await _eventually(lambda: "".join(streamed) == "l1\nl2\nl3\n")
        assert bg.pid in [p.pid for p in await sbx.commands.list()]
        assert await sbx.commands.kill(bg.pid)
        await _eventually(lambda: bg.exit_code is not None)
        assert bg.pid not in [p.pid for p in await sbx.commands.list()]

        fed = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(fed.pid, "through stdin\n")
        await sbx.commands.close_stdin(fed.pid)
        assert (await fed.wait()).stdout == "through stdin\n"

        d = str(tmp_path / "files")
        await sbx.files.write(f"{d}/a.txt", "text ü")
        await sbx.files.write(f"{d}/b.bin", bytes(range(256)))
        assert await sbx.files.read(f"{d}/a.txt") == "text ü"
        assert bytes(await sbx.files.read(f"{d}/b.bin", format="bytes")) == bytes(range(256))
        assert sorted(e.name for e in await sbx.files.list(d)) == ["a.txt", "b.bin"]
        assert await sbx.files.exists(f"{d}/a.txt") and not await sbx.files.exists(f"{d}/nope")
        info = await sbx.files.get_info(f"{d}/b.bin")
        assert (info.size, info.permissions[0]) == (256, "-")
        assert await sbx.files.make_dir(f"{d}/x/y") and not await sbx.files.make_dir(f"{d}/x/y")
        assert (await sbx.files.rename(f"{d}/a.txt", f"{d}/c.txt")).path == f"{d}/c.txt"
        await sbx.files.remove(f"{d}/c.txt")
        assert not await sbx.files.exists(f"{d}/c.txt")
        with pytest.raises(NotFoundException):
            await sbx.files.read(f"{d}/c.txt")

        events: list[str] = []
        watcher = await sbx.files.watch_dir(d, on_event=lambda e: events.append(
            f"{e.type.name}:{e.name}" if e.type == FilesystemEventType.CREATE else ""))
        await sbx.files.write(f"{d}/watched.txt", "w")
        await _eventually(lambda: "CREATE:watched.txt" in events)
        await watcher.stop()

        screen: list[bytes] = []
        term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=screen.append)
        await sbx.pty.resize(term.pid, PtySize(rows=33, cols=111))
        await sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((6*7))\n")
        await _eventually(lambda: b"pty-42" in b"".join(screen) and b"33 111" in b"".join(screen))
        assert await sbx.pty.kill(term.pid)

        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.commands.run("echo again")).stdout == "again\n"
        await sbx.set_timeout(900)
        got = await sbx.get_info()
        assert (got.state.value, got.metadata) == ("running", {"purpose": "test"})
        assert sbx.sandbox_id in [s.sandbox_id for s in await AsyncSandbox.list().next_items()]
    finally:
        await sbx.kill()
    assert not await sbx.is_running()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)


async def test_pause_then_connect_resumes_the_same_sandbox(stack: ApiStack,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-p"))
    sbx = await AsyncSandbox.create()
    await sbx.files.write("/tmp/e2b-kept.txt", "kept")  # the fake guest's /tmp is its own
    await sbx.pause()
    assert (await sbx.get_info()).state.value == "paused"
    back = await AsyncSandbox.connect(sbx.sandbox_id)
    assert back.sandbox_id == sbx.sandbox_id
    assert await back.files.read("/tmp/e2b-kept.txt") == "kept"
    await back.kill()


async def test_another_tenants_key_gets_not_found(stack: ApiStack, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-owner"))
    sbx = await AsyncSandbox.create()
    other = await stack.tenant_key("e2b-intruder")
    try:
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect(sbx.sandbox_id, api_key=other)
        with pytest.raises(NotFoundException):
            await AsyncSandbox.get_info(sbx.sandbox_id, api_key=other)
        assert await AsyncSandbox.kill(sbx.sandbox_id, api_key=other) is False
        assert sbx.sandbox_id not in [s.sandbox_id for s in
                                      await AsyncSandbox.list(api_key=other).next_items()]
        # envd calls carry the key as access token: the intruder's reaches nothing either
        async with httpx.AsyncClient(base_url=env["E2B_SANDBOX_URL"]) as client:
            for token, status in ((other, 404), ("csk_bad_bad", 401)):
                r = await client.post("/process.Process/List", json={}, headers={
                    "X-Access-Token": token, "E2b-Sandbox-Id": sbx.sandbox_id})
                assert r.status_code == status, r.text
            r = await client.get("/files", params={"path": "/etc/hostname"}, headers={
                "X-Access-Token": other, "E2b-Sandbox-Id": sbx.sandbox_id})
            assert r.status_code == 404
        assert await sbx.is_running()
    finally:
        await sbx.kill()


def _frame(message: dict[str, object]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


async def test_command_timeout_kills_the_command(stack: ApiStack, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-t"))
    sbx = await AsyncSandbox.create()
    marker = tmp_path / "late"
    try:
        with pytest.raises(TimeoutException):
            await sbx.commands.run(f"sleep 3; touch {marker}", timeout=1)
        await asyncio.sleep(3)
        assert not marker.exists()  # killed at the deadline, not left running
        assert not [p for p in await sbx.commands.list() if "sleep 3" in p.cmd]
    finally:
        await sbx.kill()


async def test_connect_wire_format(stack: ApiStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The framing details the SDKs rely on: enveloped stream messages with an end-of-stream trailer,
    Connect error codes, and ``unimplemented`` for what capsa does not serve."""
    env = _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-w"))
    sbx = await AsyncSandbox.create()
    headers = {"X-Access-Token": env["E2B_API_KEY"], "E2b-Sandbox-Id": sbx.sandbox_id,
               "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    body = b'{"process": {"cmd": "/bin/sh", "args": ["-c", "printf hi"]}}'
    async with httpx.AsyncClient(base_url=env["E2B_SANDBOX_URL"], timeout=30) as client:
        r = await client.post("/process.Process/Start", headers=headers,
                              content=struct.pack(">BI", 0, len(body)) + body)
        assert r.headers["content-type"] == "application/connect+json"
        frames, raw = [], r.content
        while raw:
            flags, length = struct.unpack(">BI", raw[:5])
            frames.append((flags, raw[5:5 + length]))
            raw = raw[5 + length:]
        assert frames[-1] == (0x02, b"{}")
        assert b'"start"' in frames[0][1] and any(b'"aGk="' in f for _, f in frames)  # base64 of "hi"
        assert b'"exitCode":0' in frames[-2][1]
        # StreamInput (client stream): a start naming the process, then data, then the body ends
        cat = await sbx.commands.run("cat", background=True, stdin=True)
        streamed = _frame({"start": {"process": {"pid": cat.pid}}}) + _frame(
            {"data": {"input": {"stdin": "c3RyZWFtZWQK"}}})  # base64 of "streamed\n"
        r = await client.post("/process.Process/StreamInput", headers=headers, content=streamed)
        assert r.status_code == 200 and r.content.endswith(struct.pack(">BI", 2, 2) + b"{}")
        await sbx.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "streamed\n"
        r = await client.post("/filesystem.Filesystem/Stat", json={"path": "/no/such/file"},
                              headers={**headers, "Content-Type": "application/json"})
        assert (r.status_code, r.json()["code"]) == (404, "not_found")
        r = await client.post("/process.Process/Nope", json={}, headers={**headers,
                                                                          "Content-Type": "application/json"})
        assert (r.status_code, r.json()["code"]) == (501, "unimplemented")
    async with httpx.AsyncClient(base_url=env["E2B_API_URL"]) as client:
        r = await client.get("/v2/sandboxes", headers={"X-API-KEY": "csk_nope_nope"})
        assert r.status_code == 401 and r.json()["code"] == 401
    await sbx.kill()


async def test_v2_listing_pages_with_next_token(stack: ApiStack, monkeypatch: pytest.MonkeyPatch) -> None:
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-l"))
    made = [await AsyncSandbox.create(metadata={"batch": "x"}) for _ in range(3)]
    paginator = AsyncSandbox.list(limit=2)
    first = await paginator.next_items()
    assert len(first) == 2 and paginator.has_next
    second = await paginator.next_items()
    assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
    assert not paginator.has_next
    for sbx in made:
        await sbx.kill()


async def test_e2b_dialect_can_be_turned_off(make_stack: object) -> None:
    assert callable(make_stack)
    stack = await make_stack(settings={"e2b_compat": False})
    async with stack.client(stack.admin_key) as client:
        assert (await client.get("/e2b/v2/sandboxes")).status_code == 404


def test_capsa_e2b_env_prints_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_API_URL", "http://capsa.example:8700/")
    monkeypatch.setenv("CAPSA_API_KEY", "csk_abcdefghijkl_secret")
    out = CliRunner().invoke(cli, ["e2b", "env"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        "export E2B_API_URL=http://capsa.example:8700/e2b",
        "export E2B_SANDBOX_URL=http://capsa.example:8700/e2b/envd",
        "export E2B_API_KEY=csk_abcdefghijkl_secret",
        "export E2B_VALIDATE_API_KEY=false",
    ]
    monkeypatch.delenv("CAPSA_API_KEY")
    missing = CliRunner().invoke(cli, ["e2b", "env"])
    assert missing.exit_code == 1 and "no API key" in missing.output


async def test_openai_agents_e2b_client(stack: ApiStack, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """The OpenAI Agents SDK's E2B sandbox client without a model: create, exec, write/read, persist and
    hydrate the workspace, shut down. (The fake guest is a host process: the workspace is under tmp_path.)"""
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from agents.sandbox.manifest import Manifest

    key = await stack.tenant_key("e2b-agents")
    _point_sdk_at(monkeypatch, stack, key)
    client = E2BSandboxClient()
    session = await client.create(options=E2BSandboxClientOptions(sandbox_type="e2b", timeout=300),
                                  manifest=Manifest(root=str(tmp_path / "workspace")))
    await session.start()
    try:
        await session.write(Path("notes/a.txt"), io.BytesIO(b"agent data"))
        result = await session.exec("sh", "-c", "ls notes; cat notes/a.txt")
        assert (result.exit_code, result.stdout) == (0, b"a.txt\nagent data")
        archive = (await session.persist_workspace()).read()
        assert (await session.exec("rm", "-rf", "notes")).exit_code == 0
        await session.hydrate_workspace(io.BytesIO(archive))
        assert (await session.read(Path("notes/a.txt"))).read() == b"agent data"
    finally:
        await session.shutdown()
        await client.delete(session)
    async with stack.client(key) as capsa_client:
        state = (await capsa_client.get(f"/v1/sessions/{session.state.sandbox_id}")).json()["state"]
    assert state == "closed"


async def test_unserved_e2b_calls_say_so(stack: ApiStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """What capsa does not serve answers 501 with a reason, not a 404 the SDK would read as "not found"."""
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-u"))
    sbx = await AsyncSandbox.create()
    try:
        with pytest.raises(SandboxException, match=r"501: POST /sandboxes/.*/snapshots is not supported"):
            await sbx.create_snapshot()
        assert await sbx.get_metrics() == []
    finally:
        await sbx.kill()


@pytest.mark.usefixtures("pinned_rate_window")
async def test_e2b_commands_count_against_the_keys_rate_limit(make_stack: object,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert callable(make_stack)
    stack = await make_stack(settings={"command_limit": 2, "rate_lease": 1})
    _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-r"))
    sbx = await AsyncSandbox.create()
    for _ in range(2):
        await sbx.commands.run("true")
    with pytest.raises(RateLimitException):
        await sbx.commands.run("true")
    await sbx.kill()


async def test_openai_agents_e2b_client_pauses_and_resumes(stack: ApiStack, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """``pause_on_exit``: shutting down pauses the capsa session; ``resume`` from the serialized state
    connects to the same sandbox (capsa resume) with its workspace."""
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from agents.sandbox.manifest import Manifest

    key = await stack.tenant_key("e2b-agents-p")
    _point_sdk_at(monkeypatch, stack, key)
    client = E2BSandboxClient()
    session = await client.create(options=E2BSandboxClientOptions(sandbox_type="e2b", pause_on_exit=True),
                                  manifest=Manifest(root=str(tmp_path / "workspace")))
    await session.start()
    await session.write(Path("kept.txt"), io.BytesIO(b"before the pause"))
    await session.shutdown()
    async with stack.client(key) as capsa_client:
        sandbox_id = session.state.sandbox_id
        assert (await capsa_client.get(f"/v1/sessions/{sandbox_id}")).json()["state"] == "paused"
    saved = client.serialize_session_state(session.state)
    resumed = await client.resume(client.deserialize_session_state(saved))
    await resumed.start()
    assert resumed.state.sandbox_id == sandbox_id
    assert (await resumed.read(Path("kept.txt"))).read() == b"before the pause"
    resumed.state.pause_on_exit = False
    await resumed.shutdown()
    async with stack.client(key) as capsa_client:
        assert (await capsa_client.get(f"/v1/sessions/{sandbox_id}")).json()["state"] == "closed"


async def test_fork_is_a_capsa_branch(stack: ApiStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """``POST /sandboxes/{id}/fork`` (e2b 2.6x ``Sandbox.fork``; 2.31 has no method for it): new sandboxes
    from the source's state, the source running on."""
    env = _point_sdk_at(monkeypatch, stack, await stack.tenant_key("e2b-f"))
    sbx = await AsyncSandbox.create()
    await sbx.files.write("/tmp/e2b-fork.txt", "parent state")
    async with httpx.AsyncClient(base_url=env["E2B_API_URL"], headers={"X-API-KEY": env["E2B_API_KEY"]},
                                 timeout=60) as client:
        r = await client.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2, "timeout": 120})
    assert r.status_code == 201, r.text
    children = [item["sandbox"]["sandboxID"] for item in r.json()]
    assert len(set(children)) == 2 and sbx.sandbox_id not in children
    for child_id in children:
        child = await AsyncSandbox.connect(child_id)
        assert await child.files.read("/tmp/e2b-fork.txt") == "parent state"
        await child.kill()
    assert await sbx.is_running()
    await sbx.kill()

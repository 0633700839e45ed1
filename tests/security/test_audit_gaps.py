"""Issue 27 (low), audit gaps: what went around the tenant audit chain. The stock ``e2b`` SDK's create,
pause, resume and fork wrote no ``session`` events and its MakeDir/Move/Remove recorded neither the session
nor the path; ``/pty?cmd=`` ran commands that were neither chained nor rate-limited (port-token traffic:
tests/security/test_port_token_audit.py). Real control plane and node (fake runtime: guest daemons as host
processes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncSandbox

from capsa.sdk import AsyncSession, RateLimited
from capsa.sdk.config import ClientConfig
from capsa.sdk.e2b import e2b_environment
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [pytest.mark.timeout(240)]


@pytest.fixture
async def stack(db_url: str, tmp_path: Path) -> AsyncIterator[ApiStack]:
    async with ApiStack(db_url, FakeRuntime(), fake_image(tmp_path / "image"),
                        settings={"command_limit": 2, "rate_lease": 1}) as s:
        yield s


async def _chain(stack: ApiStack, key: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    async with stack.client(key) as client:
        while True:
            params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            page = await client.get("/v1/audit", params=params)
            assert page.status_code == 200, page.text
            items += page.json()["items"]
            if not (cursor := page.json()["next_cursor"]):
                verified = (await client.get("/v1/audit/verify")).json()
                assert verified["ok"], verified
                return items


def _events(chain: list[dict[str, Any]], kind: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    return [(e["action"], e["session_id"], e["detail"]) for e in chain if e["kind"] == kind]


async def test_e2b_lifecycle_and_file_operations_are_chained(stack: ApiStack, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    key = await stack.tenant_key("e2b-audit")
    env = e2b_environment(ClientConfig.resolve(stack.url, key))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sbx = await AsyncSandbox.create(timeout=120)
    sid = sbx.sandbox_id
    d = str(tmp_path / "files")
    assert await sbx.files.make_dir(f"{d}/x")
    await sbx.files.write(f"{d}/a.txt", "a")
    await sbx.files.rename(f"{d}/a.txt", f"{d}/b.txt")
    await sbx.files.remove(f"{d}/b.txt")
    async with httpx.AsyncClient(base_url=env["E2B_API_URL"], headers={"X-API-KEY": key}, timeout=60) as api:
        forked = await api.post(f"/sandboxes/{sid}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        child = forked.json()[0]["sandbox"]["sandboxID"]
    await sbx.pause()
    back = await AsyncSandbox.connect(sid)
    await back.kill()
    await (await AsyncSandbox.connect(child)).kill()

    chain = await _chain(stack, key)
    sessions = _events(chain, "session")
    assert ("create", sid) in [(a, s) for a, s, _ in sessions], sessions
    assert [(a, s) for a, s, _ in sessions if a in ("branch", "pause", "resume")] == \
        [("branch", sid), ("pause", sid), ("resume", sid)], sessions
    created_child = [d for a, s, d in sessions if a == "create" and s == child]
    assert created_child and created_child[0]["branched_from"] == sid
    files = [(a, s, d.get("path"), d.get("destination")) for a, s, d in _events(chain, "file")]
    assert ("mkdir", sid, f"{d}/x", None) in files, files
    assert ("move", sid, f"{d}/a.txt", f"{d}/b.txt") in files, files
    assert ("delete", sid, f"{d}/b.txt", None) in files, files


async def test_pty_commands_are_chained_and_rate_limited(stack: ApiStack) -> None:
    key = await stack.tenant_key("pty-audit")
    async with await AsyncSession.create(api_url=stack.url, api_key=key) as session:
        async with await session.pty.create(cmd="echo from-the-pty; exit 7") as term:
            assert await term.wait() == 7
            pid = term.pid
        async with await session.pty.create(cmd="true") as term:
            await term.wait()
        with pytest.raises(RateLimited):  # command_limit 2 per window: the third terminal is refused
            await session.pty.create(cmd="echo third")
        sid = session.id
    await asyncio.sleep(0)
    commands = _events(await _chain(stack, key), "command")
    started = [d for a, s, d in commands if a == "terminal" and s == sid]
    assert [d["argv"] for d in started] == ["echo from-the-pty; exit 7", "true"], commands
    assert started[0]["pid"] == pid and started[0]["shell"] is True
    assert ("terminal_exit", sid) in [(a, s) for a, s, _ in commands]
    assert next(d["exit_code"] for a, _, d in commands if a == "terminal_exit") == 7

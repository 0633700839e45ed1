"""The public API with real microVMs: HTTP -> control plane -> node agent -> QemuRuntime -> guest daemon.

The same request paths as tests/unit/test_control_api.py (which uses host-process guests), here with the
real runtime under TCG; the main flow runs on SQLite and on a real PostgreSQL 15. Few VMs are booted
(each costs ~10 s on two shared cores)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from capsa.node.runtime.base import Runtime
from capsa.node.runtime.qemu import QemuRuntime
from tests.support.api_stack import ApiStack

pytestmark = [
    pytest.mark.vm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 not installed"),
]


def _problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["code"] == code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def vm_stack(db_url: str, guest_image: GuestImage, fresh_state_dir: Path) -> AsyncIterator[ApiStack]:
    runtime = QemuRuntime(Settings(state_dir=fresh_state_dir), accel="tcg", accel_cache=False)
    stack = ApiStack(db_url, runtime, guest_image)  # type: ignore[arg-type]
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()
    vms = fresh_state_dir / "vms"
    leftovers = list(vms.glob("*")) if vms.exists() else []
    assert leftovers == [], f"VM workdirs left behind: {leftovers}"


async def test_real_vm_session_end_to_end(vm_stack: ApiStack) -> None:
    key, other = await vm_stack.tenant_key("acme"), await vm_stack.tenant_key("intruder")
    runtime: Runtime = vm_stack.runtime
    async with vm_stack.client(key) as c, vm_stack.client(other) as intruder:
        created = await c.post(
            "/v1/sessions", json={"timeout": 600, "env": {"WHO": "capsa"}, "memory_mib": 256}
        )
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert created.json()["state"] == "running"
        (sandbox,) = runtime.list()
        qemu_pid, workdir = sandbox.pid, sandbox.workdir  # type: ignore[attr-defined]
        assert qemu_pid and _alive(qemu_pid) and workdir.exists()

        code = "import os, platform; print(platform.release(), os.environ['WHO'])"
        ran = (await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["python3", "-c", code]})).json()
        assert ran["exit_code"] == 0, ran
        release, who = ran["stdout"].split()
        assert who == "capsa" and release != platform.release()  # the guest's own kernel

        events: list[dict[str, Any]] = []
        async with c.stream(
            "POST",
            f"/v1/sessions/{sid}/commands",
            json={"cmd": "echo one; echo two >&2; exit 4"},
            headers={"Accept": "application/x-ndjson"},
        ) as response:
            assert response.status_code == 200
            events = [json.loads(line) async for line in response.aiter_lines() if line]
        assert events[-1]["type"] == "result" and events[-1]["exit_code"] == 4
        assert "".join(e["data"] for e in events if e["type"] == "stdout") == "one\n"
        assert "".join(e["data"] for e in events if e["type"] == "stderr") == "two\n"

        payload = os.urandom(1 << 20) + b"\x00end"
        put = await c.put(
            f"/v1/sessions/{sid}/files/content", params={"path": "/root/data.bin"}, content=payload
        )
        assert put.status_code == 200, put.text
        got = await c.get(f"/v1/sessions/{sid}/files/content", params={"path": "/root/data.bin"})
        assert got.content == payload
        names = [
            i["name"]
            for i in (await c.get(f"/v1/sessions/{sid}/files/list", params={"path": "/root"})).json()["items"]
        ]
        assert "data.bin" in names

        bg = await c.post(
            f"/v1/sessions/{sid}/commands", json={"cmd": "echo bg; sleep 300", "background": True}
        )
        assert bg.status_code == 201
        pid = bg.json()["pid"]
        for _ in range(100):
            out = (await c.get(f"/v1/sessions/{sid}/processes/{pid}/output")).json()
            if out["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert out["stdout"] == "bg\n" and out["running"] is True

        # Another tenant cannot see or touch it.
        _problem(await intruder.get(f"/v1/sessions/{sid}"), 404, "not_found")
        _problem(await intruder.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 404, "not_found")
        _problem(await intruder.delete(f"/v1/sessions/{sid}"), 404, "not_found")

        closed = await c.delete(f"/v1/sessions/{sid}")
        assert closed.status_code == 200 and closed.json()["state"] == "closed"
        # Nothing of the sandbox remains on the node: no QEMU process, no workdir.
        for _ in range(50):
            if not _alive(qemu_pid):
                break
            await asyncio.sleep(0.1)
        assert not _alive(qemu_pid) and not workdir.exists() and runtime.list() == []
        _problem(await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 409, "invalid_state")


async def test_real_vm_killed_from_outside_fails_its_session(vm_stack: ApiStack) -> None:
    key = await vm_stack.tenant_key("acme")
    async with vm_stack.client(key) as c:
        created = await c.post("/v1/sessions", json={"timeout": 600})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        (sandbox,) = vm_stack.runtime.list()
        os.kill(sandbox.pid, 9)  # type: ignore[attr-defined]
        await asyncio.sleep(1.0)
        _problem(await c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true"}), 409, "session_failed")
        state = (await c.get(f"/v1/sessions/{sid}")).json()
        assert state["state"] == "failed" and state["failure_reason"]
        assert vm_stack.runtime.list() == []

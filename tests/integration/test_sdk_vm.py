"""The SDK against a real ``capsa serve`` with real microVMs: streaming, timeouts, background processes,
large streamed files, tar archives, and a sandbox killed from outside surfacing as ``SessionFailed``."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import tarfile
from pathlib import Path

import pytest

from capsa import AsyncClient, AsyncSession, SessionFailed
from tests.support.counter import COUNTER_FILE, counter_past, counter_script
from tests.support.leftovers import wait_no_vm_leftovers
from tests.support.processes import qemu_pids
from tests.support.served import Served, capsa

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def server(server: tuple[Served, str]) -> tuple[Served, str]:
    """The module's ``capsa serve`` (tests/integration/conftest.py), with a tenant key instead of the
    admin key."""
    served, admin = server
    made = capsa(served, admin, "keys", "create", "--tenant", "sdk-vm")
    assert made.returncode == 0, made.stderr
    return served, made.stdout.strip()


async def test_sdk_features_in_a_real_vm(server: tuple[Served, str], tmp_path: Path) -> None:
    served, key = server
    async with AsyncClient(served.url, key) as client, await AsyncSession.create(client=client) as s:
        # streamed output arrives in several chunks, before the command ends
        chunks: list[str] = []
        res = await s.commands.run("for i in 1 2 3 4; do echo line $i; sleep 0.3; done",
                                   on_stdout=chunks.append)
        assert res.exit_code == 0 and res.stdout == "".join(f"line {i}\n" for i in range(1, 5))
        assert len(chunks) >= 2

        res = await s.commands.run("sleep 30", timeout=1)
        assert res.timed_out and not res.ok

        res = await s.commands.run("id -un; pwd", cwd="/tmp", env={"A": "b"})
        assert res.stdout.splitlines()[1] == "/tmp"

        proc = await s.commands.run(counter_script(), background=True)

        async def counter() -> int:
            return int((await s.commands.run(f"cat {COUNTER_FILE} 2>/dev/null || echo 0")).stdout)

        first = await counter_past(counter, 0)
        await counter_past(counter, first)  # kept running between two execs
        assert (await proc.refresh()).running
        await proc.kill()
        done = await proc.wait(20, poll_interval=0.2)
        assert not done.running

        blob = os.urandom(20 * 1024 * 1024)
        local = tmp_path / "blob"
        await asyncio.to_thread(local.write_bytes, blob)
        info = await s.files.upload("/root/blob", local)
        assert info.size == len(blob)
        digest = (await s.commands.run("sha256sum /root/blob")).stdout.split()[0]
        assert digest == hashlib.sha256(blob).hexdigest()
        back = tmp_path / "back"
        assert await s.files.download("/root/blob", back) == len(blob)
        assert hashlib.sha256(await asyncio.to_thread(back.read_bytes)).hexdigest() == digest

        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for name, data in (("a.txt", b"alpha"), ("sub/b.bin", bytes(range(256)))):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        await s.files.mkdir("/root/tree")
        await s.files.upload_tar("/root/tree", archive.getvalue())
        assert await s.files.read("/root/tree/a.txt") == "alpha"
        out = io.BytesIO()
        await s.files.download_tar("/root/tree", out)
        out.seek(0)
        with tarfile.open(fileobj=out) as tar:
            names = {m.name.lstrip("./") for m in tar.getmembers() if m.isfile()}
        assert names == {"a.txt", "sub/b.bin"}
    assert s.state == "closed"
    assert wait_no_vm_leftovers(served.state_dir) == []


async def test_killed_vm_surfaces_as_session_failed(server: tuple[Served, str]) -> None:
    served, key = server
    async with AsyncClient(served.url, key) as client:
        s = await AsyncSession.create(client=client)
        assert (await s.commands.run("true")).ok
        pids = await asyncio.to_thread(qemu_pids, served.state_dir)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(SessionFailed):
            for _ in range(50):  # the node notices the exit within moments; no hang either way
                await s.commands.run("true", timeout=10)
                await asyncio.sleep(0.2)
        info = await s.refresh()
        assert info.state == "failed" and info.failure_reason
        await s.close()  # closing a failed session is allowed and cleans up
    assert wait_no_vm_leftovers(served.state_dir) == []

"""The stock ``e2b`` SDK and the OpenAI Agents SDK's E2B sandbox client against a real ``capsa serve``
with real microVMs, configured only by the environment that ``capsa e2b env`` prints."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import NotFoundException, PtySize, Sandbox

from tests.support.processes import qemu_pids
from tests.support.served import Served, capsa

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def tenants(server: tuple[Served, str]) -> tuple[Served, str, str]:
    """The module's ``capsa serve`` and two tenants' keys."""
    served, admin = server
    keys = []
    for tenant in ("e2b-vm-a", "e2b-vm-b"):
        made = capsa(served, admin, "keys", "create", "--tenant", tenant)
        assert made.returncode == 0, made.stderr
        keys.append(made.stdout.strip())
    return served, keys[0], keys[1]


@pytest.fixture
def e2b_env(tenants: tuple[Served, str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Tenant a's ``eval "$(capsa e2b env)"``, applied to this process's environment."""
    served, key, _ = tenants
    printed = capsa(served, key, "e2b", "env")
    assert printed.returncode == 0, printed.stderr
    env: dict[str, str] = {}
    for line in printed.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    for name in list(env):
        monkeypatch.setenv(name, env[name])
    yield env


def _capsa_session(served: Served, key: str, session_id: str) -> dict[str, object]:
    """The session behind an E2B sandbox, as capsa's own API shows it."""
    r = httpx.get(f"{served.url}/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def _until(check: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _waiting(wait: Callable[[], object]) -> threading.Thread:
    """The sync SDK delivers a background command's output while something waits on it."""
    def run() -> None:
        with contextlib.suppress(Exception):  # a killed command raises CommandExitException
            wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_stock_e2b_sdk_in_a_real_microvm(tenants: tuple[Served, str, str], e2b_env: dict[str, str]) -> None:
    served, key, _ = tenants
    before = len(qemu_pids(served.state_dir))
    sbx = Sandbox.create(timeout=600)
    try:
        # the sandbox is a capsa session with its own microVM
        session = _capsa_session(served, key, sbx.sandbox_id)
        assert session["state"] == "running" and session["node_id"]
        assert len(qemu_pids(served.state_dir)) == before + 1
        # PID 1 is capsa's guest init: the command ran in the microVM
        assert "capsa.guest.init" in sbx.commands.run("tr '\\0' ' ' < /proc/1/cmdline").stdout

        r = sbx.commands.run("echo hello; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0)

        seen: list[str] = []
        bg = sbx.commands.run("for i in 1 2 3; do echo l$i; sleep 0.2; done; sleep 120", background=True)
        waiter = _waiting(lambda: bg.wait(on_stdout=seen.append))
        _until(lambda: "".join(seen) == "l1\nl2\nl3\n")
        assert bg.pid in [p.pid for p in sbx.commands.list()]
        assert bg.kill()
        waiter.join(30)
        assert not waiter.is_alive() and bg.pid not in [p.pid for p in sbx.commands.list()]

        fed = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(fed.pid, "through stdin\n")
        sbx.commands.close_stdin(fed.pid)
        assert fed.wait().stdout == "through stdin\n"

        sbx.files.write("/root/e2b/a.txt", "text ü")
        sbx.files.write("/root/e2b/b.bin", bytes(range(256)))
        assert sbx.files.read("/root/e2b/a.txt") == "text ü"
        assert bytes(sbx.files.read("/root/e2b/b.bin", format="bytes")) == bytes(range(256))
        assert sorted(e.name for e in sbx.files.list("/root/e2b")) == ["a.txt", "b.bin"]
        assert sbx.files.exists("/root/e2b/a.txt") and not sbx.files.exists("/root/e2b/nope")
        assert sbx.files.get_info("/root/e2b/b.bin").size == 256
        assert sbx.files.make_dir("e2b/sub/dir")  # relative to the user's home (/root)
        assert not sbx.files.make_dir("/root/e2b/sub/dir")
        assert sbx.files.rename("/root/e2b/a.txt", "/root/e2b/c.txt").name == "c.txt"
        sbx.files.remove("/root/e2b/c.txt")
        assert not sbx.files.exists("/root/e2b/c.txt")
        assert sbx.commands.run("ls /root/e2b").stdout.split() == ["b.bin", "sub"]

        watcher = sbx.files.watch_dir("/root/e2b")
        sbx.files.write("/root/e2b/watched.txt", "w")
        names: set[str] = set()

        def saw_it() -> bool:
            names.update(e.name for e in watcher.get_new_events())
            return "watched.txt" in names

        _until(saw_it)
        watcher.stop()

        screen: list[bytes] = []
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        reader = _waiting(lambda: term.wait(on_pty=screen.append))
        sbx.pty.resize(term.pid, PtySize(rows=33, cols=111))
        sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((6*7))\n")
        _until(lambda: b"pty-42" in b"".join(screen) and b"33 111" in b"".join(screen))
        assert sbx.pty.kill(term.pid)
        reader.join(30)

        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /root/e2b/watched.txt").stdout == "w"
        sbx.set_timeout(1200)
        info = sbx.get_info()
        assert info.state.value == "running" and info.end_at.timestamp() > time.time() + 1100
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    finally:
        sbx.kill()
    assert not sbx.is_running()
    assert _capsa_session(served, key, sbx.sandbox_id)["state"] == "closed"
    _until(lambda: len(qemu_pids(served.state_dir)) == before)


def test_another_tenant_cannot_reach_the_sandbox(tenants: tuple[Served, str, str],
                                                 e2b_env: dict[str, str]) -> None:
    _, _, other = tenants
    sbx = Sandbox.create()
    try:
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=other)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id, api_key=other)
        assert Sandbox.kill(sbx.sandbox_id, api_key=other) is False
        assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=other).next_items()]
        assert sbx.is_running()
    finally:
        sbx.kill()


async def test_openai_agents_e2b_client_in_a_real_microvm(tenants: tuple[Served, str, str],
                                                          e2b_env: dict[str, str]) -> None:
    """The OpenAI Agents SDK's E2B sandbox client, driven without a model: create, exec, write/read,
    persist and hydrate the workspace, shut down (the capsa session closes)."""
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from agents.sandbox.manifest import Manifest

    served, key, _ = tenants
    client = E2BSandboxClient()
    session = await client.create(options=E2BSandboxClientOptions(sandbox_type="e2b", timeout=600),
                                  manifest=Manifest())
    sandbox_id = session.state.sandbox_id
    await session.start()
    try:
        await session.write(Path("notes/plan.md"), io.BytesIO(b"step 1: list files\n"))
        listed = await session.exec("sh", "-c", "pwd; ls notes; uname -s")
        assert listed.exit_code == 0
        assert listed.stdout.decode().split() == ["/workspace", "plan.md", "Linux"]
        assert (await session.read(Path("notes/plan.md"))).read() == b"step 1: list files\n"
        failed = await session.exec("sh", "-c", "echo nope >&2; exit 3")
        assert (failed.exit_code, failed.stderr) == (3, b"nope\n")

        archive = (await session.persist_workspace()).read()
        assert len(archive) > 0
        assert (await session.exec("rm", "-rf", "notes")).exit_code == 0
        await session.hydrate_workspace(io.BytesIO(archive))
        assert (await session.read(Path("notes/plan.md"))).read() == b"step 1: list files\n"
    finally:
        await session.shutdown()
        await client.delete(session)
    assert _capsa_session(served, key, sandbox_id)["state"] == "closed"


async def test_openai_agents_e2b_client_pause_and_resume_in_a_real_microvm(
        tenants: tuple[Served, str, str], e2b_env: dict[str, str]) -> None:
    """``pause_on_exit``: shutting down pauses the session (capsa snapshot, VM gone); ``resume`` from the
    serialized state brings the same sandbox back with its workspace and running state."""
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from agents.sandbox.manifest import Manifest

    served, key, _ = tenants
    client = E2BSandboxClient()
    session = await client.create(options=E2BSandboxClientOptions(sandbox_type="e2b", pause_on_exit=True),
                                  manifest=Manifest())
    await session.start()
    sandbox_id = session.state.sandbox_id
    await session.write(Path("kept.txt"), io.BytesIO(b"before the pause"))
    await session.shutdown()
    assert _capsa_session(served, key, sandbox_id)["state"] == "paused"
    saved = client.serialize_session_state(session.state)
    resumed = await client.resume(client.deserialize_session_state(saved))
    await resumed.start()
    try:
        assert resumed.state.sandbox_id == sandbox_id
        assert (await resumed.read(Path("kept.txt"))).read() == b"before the pause"
    finally:
        resumed.state.pause_on_exit = False
        await resumed.shutdown()
    assert _capsa_session(served, key, sandbox_id)["state"] == "closed"

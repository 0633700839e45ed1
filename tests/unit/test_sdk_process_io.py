"""The SDK's terminals, process stdin, streamed waits with reattach and directory watches, async and
blocking, against the API stack (fake runtime: real guest daemons as confined host processes)."""

from __future__ import annotations

import asyncio

import pytest

from capsa.sdk import (
    AsyncClient,
    AsyncSession,
    FileEvent,
    InvalidState,
    NotFound,
    OutputChunk,
    OutputEnd,
    Session,
)
from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.timeout(120)

READ_LINES = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)"


async def test_pty_create_send_resize_wait_and_kill(steady_stack: ApiStack) -> None:
    stack = steady_stack
    key = await stack.tenant_key("acme")
    async with AsyncClient(stack.url, key) as client, await AsyncSession.create(client=client) as s:
        term = await s.pty.create(cols=100, rows=30, cmd="PS1='$ ' exec /bin/sh -i")
        assert term.pid > 0 and term.exit_code is None
        seen = b""
        await term.send("stty size\n")
        async for chunk in term:
            seen += chunk
            if b"30 100" in seen:
                break
        await term.resize(140, 50)
        await term.send(b"stty size; exit 4\n")
        rest = b"".join([chunk async for chunk in term])
        assert b"50 140" in rest and term.exit_code == 4 and term.closed
        assert await term.wait() == 4
        await term.close()

        async with await s.pty.create(cmd="sleep 300") as sleeper:
            await sleeper.kill()
            assert await sleeper.wait() is None and sleeper.signal == 9
        with pytest.raises(ValueError, match="cols"):
            await s.pty.create(cols=0)


async def test_pty_refusals_are_sdk_errors(steady_stack: ApiStack) -> None:
    stack = steady_stack
    async with AsyncClient(stack.url, await stack.tenant_key("acme")) as client, \
            AsyncClient(stack.url, await stack.tenant_key("globex")) as intruder:
        async with await AsyncSession.create(client=client) as s:
            other = AsyncSession(s.info, intruder)
            with pytest.raises(NotFound):
                await other.pty.create()
        with pytest.raises(InvalidState):  # closed: not running
            await s.pty.create()


async def test_stdin_and_a_streamed_wait_with_reattach(steady_stack: ApiStack) -> None:
    stack = steady_stack
    key = await stack.tenant_key("acme")
    async with AsyncClient(stack.url, key) as client, await AsyncSession.create(client=client) as s:
        proc = await s.commands.run(["python3", "-c", READ_LINES], background=True, open_stdin=True)
        assert proc.info.stdin_open
        await proc.send_stdin("one\n")
        await proc.send_stdin(b"two\n")
        await proc.close_stdin()
        lines: list[str] = []
        out = await proc.wait(timeout=30, on_stdout=lines.append)
        assert "".join(lines) == "got one\ngot two\n" == out.stdout and out.exit_code == 0
        with pytest.raises(InvalidState) as e:
            await proc.send_stdin("late")
        assert e.value.code == "process_exited"

        script = "for i in $(seq 1 10); do echo t$i; sleep 0.1; done"
        ticker = await s.commands.run(script, background=True)
        got = ""
        async for event in ticker.stream():
            assert isinstance(event, OutputChunk)
            got += event.data
            if "t3" in got:
                break  # the client goes away mid-stream
        again = await s.commands.connect(ticker.pid, stdout_from=ticker.stdout_offset,
                                         stderr_from=ticker.stderr_offset)
        rest: list[str] = []
        final = await again.wait(timeout=30, on_stdout=rest.append)
        assert got + "".join(rest) == "".join(f"t{i}\n" for i in range(1, 11))
        assert final.exit_code == 0 and again.stdout_offset == len(got + "".join(rest))
        events = [e async for e in again.stream()]  # after the end: only the end
        assert len(events) == 1 and isinstance(events[0], OutputEnd)


async def test_files_watch_async(steady_stack: ApiStack) -> None:
    stack = steady_stack
    key = await stack.tenant_key("acme")
    async with AsyncClient(stack.url, key) as client, await AsyncSession.create(client=client) as s:
        folder = (await s.commands.run("mktemp -d")).stdout.strip()
        f = f"{folder}/a"

        async def change() -> None:
            await s.commands.run(f"touch {f}; sleep 0.3; echo 1 >> {f}; sleep 0.3; rm {f}")

        got: list[FileEvent] = []
        watch = await s.files.watch(folder)
        task = asyncio.create_task(change())
        async with asyncio.timeout(30):
            async for event in watch:
                got.append(event)
                if len(got) == 3:
                    break
        await watch.aclose()
        await task
        assert [(e.type, e.path) for e in got] == [("created", f), ("modified", f), ("removed", f)]
        with pytest.raises(NotFound):
            await s.files.watch(f"{folder}/missing")


async def test_blocking_twins_from_a_thread(steady_stack: ApiStack) -> None:
    stack = steady_stack
    key = await stack.tenant_key("acme")
    errors: list[BaseException] = []
    results: dict[str, object] = {}

    def body() -> None:
        try:
            with Session.create(api_url=stack.url, api_key=key) as s:
                with s.pty.create(cols=70, rows=21, cmd="stty size; exit 6") as term:
                    results["out"] = b"".join(term)
                    results["code"] = term.exit_code
                proc = s.commands.run("cat", background=True, open_stdin=True)
                proc.send_stdin("piped\n")
                proc.close_stdin()
                results["cat"] = "".join(e.data for e in proc.stream() if isinstance(e, OutputChunk))
                folder = s.commands.run("mktemp -d").stdout.strip()
                with s.files.watch(folder) as watch:
                    s.commands.run(f"touch {folder}/x")
                    results["watch"] = watch.next()
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    await asyncio.to_thread(body)  # the stack serves on this loop meanwhile
    assert not errors, errors
    assert b"21 70" in results["out"] and results["code"] == 6  # type: ignore[operator]
    assert results["cat"] == "piped\n"
    assert isinstance(results["watch"], FileEvent) and results["watch"].type == "created"

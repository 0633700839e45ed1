"""Terminals, background stdin, streamed process output and directory watches through the public API
(control plane + node over HTTP, fake runtime: real guest daemons as confined host processes), with raw
HTTP and WebSocket clients: auth, tenant isolation, problem+json before upgrades, reattach, idle timeout,
and nothing left behind when the session closes under an open stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from capsa.common.errors import CapsaError
from capsa.common.terminal_wire import TerminalClient
from capsa.common.websocket import SocketStream, WebSocketClient, WebSocketRejected
from tests.support.api_stack import ApiStack
from tests.support.problems import assert_problem
from tests.support.processes import processes_with

pytestmark = pytest.mark.timeout(120)

READ_LINES = "import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)"


async def new_session(client: httpx.AsyncClient, **body: Any) -> str:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def background(client: httpx.AsyncClient, sid: str, cmd: Any, **extra: Any) -> int:
    started = await client.post(f"/v1/sessions/{sid}/commands",
                                json={"cmd": cmd, "background": True, **extra})
    assert started.status_code == 201, started.text
    return int(started.json()["pid"])


async def stream_lines(client: httpx.AsyncClient, path: str, params: dict[str, Any] | None = None,
                       stop: Any = None) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    async with client.stream("GET", path, params=params, timeout=60) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("application/x-ndjson")
        async for line in response.aiter_lines():
            if line:
                lines.append(json.loads(line))
                if stop is not None and stop(lines):
                    break
    return lines


async def terminal(stack: ApiStack, sid: str, key: str | None, query: str = "") -> TerminalClient:
    url = urlsplit(stack.url)
    stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
    headers = [("Authorization", f"Bearer {key}")] if key else []
    return await TerminalClient.connect(stream, url.netloc, f"/v1/sessions/{sid}/pty{query}", headers=headers)


async def read_until(term: TerminalClient, needle: bytes, seen: bytearray) -> None:
    async with asyncio.timeout(30):
        while needle not in seen:
            chunk = await term.recv()
            assert chunk is not None, f"terminal ended before {needle!r}: {bytes(seen)!r}"
            seen += chunk


async def test_stdin_two_writes_close_and_the_errors(stack: ApiStack) -> None:
    stack = stack
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("globex")
    async with stack.client(key) as client, stack.client(other) as intruder:
        sid = await new_session(client)
        pid = await background(client, sid, ["python3", "-c", READ_LINES], open_stdin=True)
        base = f"/v1/sessions/{sid}/processes/{pid}"
        assert (await client.get(base)).json()["stdin_open"] is True
        for data in (b"one\n", b"two\n"):
            wrote = await client.post(f"{base}/stdin", content=data,
                                      headers={"Content-Type": "application/octet-stream"})
            assert wrote.status_code == 200, wrote.text
        assert_problem(await intruder.post(f"{base}/stdin", content=b"x"), 404, "not_found")
        closed = await client.post(f"{base}/stdin/close")
        assert closed.status_code == 200 and closed.json()["stdin_open"] is False
        lines = await stream_lines(client, f"{base}/stream")
        assert lines[-1]["type"] == "exit" and lines[-1]["exit_code"] == 0
        assert "".join(x["data"] for x in lines if x["type"] == "output") == "got one\ngot two\n"
        assert_problem(await client.post(f"{base}/stdin", content=b"late"), 409, "process_exited")
        no_pipe = await background(client, sid, "sleep 30")
        assert_problem(await client.post(f"/v1/sessions/{sid}/processes/{no_pipe}/stdin", content=b"x"),
                       409, "stdin_closed")
        assert_problem(await client.post(f"/v1/sessions/{sid}/processes/4000000/stdin/close"),
                       404, "no_such_process")


async def test_output_stream_reattach_gets_the_rest_once(stack: ApiStack) -> None:
    stack = stack
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        sid = await new_session(client)
        script = "for i in $(seq 1 15); do echo out$i; echo err$i >&2; sleep 0.1; done; exit 5"
        pid = await background(client, sid, script)
        path = f"/v1/sessions/{sid}/processes/{pid}/stream"
        first = await stream_lines(client, path, stop=lambda got: len(got) >= 4)  # then disconnect
        offsets = {"stdout": 0, "stderr": 0}
        text = {"stdout": "", "stderr": ""}
        for line in first:
            text[line["ch"]] += line["data"]
            offsets[line["ch"]] = line["offset"]
        await asyncio.sleep(0.5)
        rest = await stream_lines(client, path, {"stdout_from": offsets["stdout"],
                                                 "stderr_from": offsets["stderr"]})
        for line in rest[:-1]:
            assert line["type"] == "output" and line["lost"] == 0
            text[line["ch"]] += line["data"]
        end = rest[-1]
        assert end == {"type": "exit", "exit_code": 5, "signal": None,
                       "stdout_end": len(text["stdout"]), "stderr_end": len(text["stderr"])}
        assert text["stdout"] == "".join(f"out{i}\n" for i in range(1, 16))
        assert text["stderr"] == "".join(f"err{i}\n" for i in range(1, 16))
        assert_problem(await client.get(f"/v1/sessions/{sid}/processes/4000000/stream"),
                       404, "no_such_process")
        assert_problem(await client.get(path, params={"stdout_from": -1}), 422, "validation_error")


async def test_watch_stream_over_http(stack: ApiStack) -> None:
    stack = stack
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("globex")
    async with stack.client(key) as client, stack.client(other) as intruder:
        sid = await new_session(client)
        made = await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": "mktemp -d"})
        folder = made.json()["stdout"].strip()
        f = f"{folder}/f.txt"

        async def change() -> None:
            await asyncio.sleep(0.5)
            done = await client.post(f"/v1/sessions/{sid}/commands",
                                     json={"cmd": f"touch {f}; sleep 0.3; echo x >> {f}; sleep 0.3; rm {f}"})
            assert done.json()["exit_code"] == 0

        changer = asyncio.create_task(change())
        got = await stream_lines(client, f"/v1/sessions/{sid}/files/watch", {"path": folder},
                                 stop=lambda lines: len(lines) >= 3)
        await changer
        assert [(x["type"], x["path"]) for x in got] == [("created", f), ("modified", f), ("removed", f)]
        assert_problem(await intruder.get(f"/v1/sessions/{sid}/files/watch", params={"path": folder}),
                       404, "not_found")
        assert_problem(await client.get(f"/v1/sessions/{sid}/files/watch", params={"path": f"{folder}/nope"}),
                       404, "not_found")


async def test_terminal_through_the_api(stack: ApiStack) -> None:
    stack = stack
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        sid = await new_session(client, env={"WHO": "capsa"})
    term = await terminal(stack, sid, key, "?cols=90&rows=20&cmd=/bin/sh&env=PS1=%24%20")
    seen = bytearray()
    await term.send(b"tty; stty size; echo $WHO\n")
    await read_until(term, b"20 90", seen)
    await read_until(term, b"capsa", seen)
    assert b"/dev/pts/" in seen
    await term.resize(132, 50)
    await term.send(b"stty size; exit 3\n")
    async with asyncio.timeout(30):
        while (chunk := await term.recv()) is not None:
            seen += chunk
    assert b"50 132" in seen
    assert term.exit is not None and term.exit.exit_code == 3
    await term.close()


async def test_terminal_refusals_are_problems_before_the_upgrade(stack: ApiStack) -> None:
    stack = stack
    key, other = await stack.tenant_key("acme"), await stack.tenant_key("globex")
    async with stack.client(key) as client:
        sid = await new_session(client)
    url = urlsplit(stack.url)
    for who, query, status, code in [
        (None, "", 401, "unauthorized"),
        (other, "", 404, "not_found"),
        (key, "?cols=0", 422, "validation_error"),
        (key, "?rows=abc", 422, "validation_error"),
        (key, "?cols=10001", 422, "validation_error"),
        (key, "?cwd=relative", 422, "validation_error"),
    ]:
        stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
        headers = [("Authorization", f"Bearer {who}")] if who else []
        with pytest.raises(WebSocketRejected) as refused:
            await WebSocketClient.connect(stream, url.netloc, f"/v1/sessions/{sid}/pty{query}",
                                          headers=headers)
        await stream.aclose()
        assert refused.value.status == status, query
        body = json.loads(refused.value.body)
        assert body["code"] == code and body["status"] == status
        assert dict(refused.value.headers)[b"content-type"].startswith(b"application/problem+json")


async def test_an_open_terminal_keeps_the_session_from_its_idle_timeout(
        make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from capsa.control.ports import access as port_access

    monkeypatch.setattr(port_access, "ACTIVITY_INTERVAL", 0.2)
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        sid = await new_session(client, idle_timeout=2)
        term = await terminal(stack, sid, key, "?cmd=sleep%20300")
        await asyncio.sleep(4)  # twice the idle timeout, nothing sent
        assert (await client.get(f"/v1/sessions/{sid}")).json()["state"] == "running"
        await term.close()
        deadline = time.monotonic() + 20  # closed, it goes idle: the reaper ends the session
        while (await client.get(f"/v1/sessions/{sid}")).json()["state"] == "running":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)


async def test_closing_the_session_ends_open_terminals_streams_and_watches(stack: ApiStack) -> None:
    """Closing the session under an open terminal, output stream and watch ends all three; no guest
    process, no sandbox and no server task is left."""
    stack = stack
    key = await stack.tenant_key("acme")
    marker = f"capsa-open-{uuid.uuid4().hex}"
    async with stack.client(key) as client:
        sid = await new_session(client)
        baseline = len(asyncio.all_tasks())
        term = await terminal(stack, sid, key, f"?cmd=sleep%20300%3B%20%3A%20{marker}-pty")
        pid = await background(client, sid, f"sleep 300; : {marker}-bg")
        made = await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": "mktemp -d"})
        folder = made.json()["stdout"].strip()

        async def drain(path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            try:
                async with client.stream("GET", path, params=params, timeout=60) as response:
                    async for line in response.aiter_lines():
                        if line:
                            out.append(json.loads(line))
            except httpx.HTTPError:
                out.append({"type": "broken"})
            return out

        streaming = asyncio.create_task(drain(f"/v1/sessions/{sid}/processes/{pid}/stream", {}))
        watching = asyncio.create_task(drain(f"/v1/sessions/{sid}/files/watch", {"path": folder}))
        for _ in range(100):
            if processes_with(marker + "-pty") and processes_with(marker + "-bg"):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        closed = await client.delete(f"/v1/sessions/{sid}")
        assert closed.status_code in (200, 202, 204), closed.text
        async with asyncio.timeout(30):
            with contextlib.suppress(CapsaError):  # the sandbox went away under the terminal
                while await term.recv() is not None:
                    pass
            ended = await asyncio.gather(streaming, watching)
        assert all(lines == [] or lines[-1]["type"] in ("error", "broken") for lines in ended), ended
        for _ in range(100):
            if not processes_with(marker):
                break
            await asyncio.sleep(0.1)
        assert processes_with(marker) == []
        assert stack.agent.list() == []
        await term.close()
        for _ in range(100):  # the relays and activity marks of the control plane (it serves on this loop)
            if len(asyncio.all_tasks()) <= baseline:
                break
            await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) <= baseline, [t.get_coro() for t in asyncio.all_tasks()]


async def test_clients_that_leave_leave_no_task_and_no_process(stack: ApiStack) -> None:
    """A client closing its terminal, output stream or watch: the guest's terminal is hung up, and the
    server's tasks (relays, activity marks) are gone (the stack serves on this loop, so they are visible)."""
    stack = stack
    key = await stack.tenant_key("acme")
    marker = f"capsa-leave-{uuid.uuid4().hex}"
    async with stack.client(key) as client:
        sid = await new_session(client)
        pid = await background(client, sid, "while true; do echo tick; sleep 0.2; done")
        made = await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": "mktemp -d"})
        folder = made.json()["stdout"].strip()
        await asyncio.sleep(0.5)
        baseline = len(asyncio.all_tasks())
        for _ in range(3):
            term = await terminal(stack, sid, key, f"?cmd=sleep%20300%3B%20%3A%20{marker}")
            for _ in range(100):
                if processes_with(marker):
                    break
                await asyncio.sleep(0.05)
            assert processes_with(marker)
            got = await stream_lines(client, f"/v1/sessions/{sid}/processes/{pid}/stream",
                                     stop=lambda lines: len(lines) >= 2)
            assert got[0]["type"] == "output"
            watch_task = asyncio.create_task(stream_lines(client, f"/v1/sessions/{sid}/files/watch",
                                                          {"path": folder}))
            await asyncio.sleep(0.5)
            watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch_task
            await term.close()
            for _ in range(100):
                if not processes_with(marker):
                    break
                await asyncio.sleep(0.05)
            assert processes_with(marker) == []
        for _ in range(100):
            if len(asyncio.all_tasks()) <= baseline:
                break
            await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) <= baseline, [t.get_coro() for t in asyncio.all_tasks()]

"""What the SDK sends and how it reads answers, checked against scripted HTTP exchanges.

These pin the SDK's side of docs/api-contract.md. Behaviour against the real server is covered by
test_sdk_app.py (in-process app) and tests/integration/test_sdk*.py (real `capsa serve` and VMs).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from capsa.sdk import (
    AsyncClient,
    AsyncProcess,
    AsyncSession,
    CapsaClientError,
    CapsaConnectionError,
    CommandResult,
    ProcessInfo,
    SessionFailed,
    SessionInfo,
    UnexpectedResponse,
)

NOW = "2026-11-30T04:00:00Z"


def session_json(sid: str = "ses_aaaaaaaaaaaaaaaaaaaa", state: str = "running",
                 **extra: Any) -> dict[str, Any]:
    return {"id": sid, "tenant": "t1", "state": state, "template": "base", "created_at": NOW,
            "updated_at": NOW, "expires_at": NOW, "idle_timeout": None, "last_activity_at": NOW,
            "metadata": {}, "memory_mib": 256, "vcpus": 1, "node_id": "local", "failure_reason": None,
            "closed_at": None, "some_future_field": 1, **extra}


Handler = Callable[[httpx.Request], Any]


class Recorder:
    """Answers with ``handler`` and keeps every request (with its body read) for assertions."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(await request.aread())
        self.requests.append(request)
        result = self.handler(request)
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, httpx.Response)
        return result

    def client(self) -> AsyncClient:
        return AsyncClient("http://capsa.test/", "csk_abcdefabcdef_secret",
                           transport=httpx.MockTransport(self))

    def json_body(self, i: int = -1) -> Any:
        return json.loads(self.bodies[i])


async def connected(rec: Recorder) -> AsyncSession:
    return AsyncSession(SessionInfo.model_validate(session_json()), rec.client(), owns_client=True)


async def test_create_sends_only_given_fields_and_auth() -> None:
    rec = Recorder(lambda r: httpx.Response(201, json=session_json()))
    s = await AsyncSession.create("python", timeout=120, env={"A": "1"}, api_url="http://capsa.test",
                                  api_key="csk_abcdefabcdef_secret", transport=httpx.MockTransport(rec))
    req = rec.requests[0]
    assert (req.method, req.url.path) == ("POST", "/v1/sessions")
    assert req.headers["authorization"] == "Bearer csk_abcdefabcdef_secret"
    assert req.headers["user-agent"].startswith("capsa-sdk/")
    assert rec.json_body() == {"template": "python", "timeout": 120, "env": {"A": "1"}}
    assert s.id == "ses_aaaaaaaaaaaaaaaaaaaa" and s.state == "running" and s.info.memory_mib == 256
    await s.disconnect()


async def test_ids_are_quoted_into_one_path_segment() -> None:
    rec = Recorder(lambda r: httpx.Response(404, json={"code": "not_found", "detail": "no", "status": 404}))
    async with rec.client() as client:
        with pytest.raises(Exception):  # noqa: B017 - only the URL matters here
            await client.get_session("../keys")
    assert rec.requests[0].url.raw_path == b"/v1/sessions/..%2Fkeys"


async def test_list_follows_cursors_and_encodes_filters() -> None:
    pages = {None: (["ses_1", "ses_2"], "c2"), "c2": (["ses_3"], None)}

    def handler(r: httpx.Request) -> httpx.Response:
        ids, nxt = pages[r.url.params.get("cursor")]
        return httpx.Response(200, json={"items": [session_json(i) for i in ids], "next_cursor": nxt})

    rec = Recorder(handler)
    async with rec.client() as client:
        items = await AsyncSession.list(state="running", metadata={"team": "a b"}, client=client)
        assert [s.id for s in items] == ["ses_1", "ses_2", "ses_3"]
        first = rec.requests[0].url.params
        assert first["state"] == "running" and first["metadata.team"] == "a b" and "cursor" not in first
        assert rec.requests[1].url.params["cursor"] == "c2"
        limited = await client.list_sessions(limit=1)
        assert [s.id for s in limited] == ["ses_1"]
        assert rec.requests[-1].url.params["limit"] == "1"


async def test_run_buffered() -> None:
    result = {"exit_code": 3, "signal": None, "stdout": "out", "stderr": "err", "stdout_truncated": False,
              "stderr_truncated": False, "timed_out": False, "duration_ms": 12.5}
    rec = Recorder(lambda r: httpx.Response(200, json=result))
    s = await connected(rec)
    res = await s.commands.run(["python3", "-c", "x"], timeout=5, env={"K": "V"}, cwd="/tmp", stdin="in")
    assert isinstance(res, CommandResult)
    assert (res.exit_code, res.stdout, res.stderr, res.ok) == (3, "out", "err", False)
    body = rec.json_body()
    assert body == {"cmd": ["python3", "-c", "x"], "env": {"K": "V"}, "cwd": "/tmp", "user": None,
                    "timeout": 5, "stdin": "in", "background": False}
    assert rec.requests[0].url.path == "/v1/sessions/ses_aaaaaaaaaaaaaaaaaaaa/commands"
    await s.disconnect()


def ndjson(events: list[dict[str, Any]]) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        for e in events:
            yield (json.dumps(e) + "\n").encode()
            await asyncio.sleep(0)

    return httpx.Response(200, content=body(), headers={"content-type": "application/x-ndjson"})


async def test_run_streaming_calls_sync_and_async_callbacks_in_order() -> None:
    events: list[dict[str, Any]] = [
        {"type": "stdout", "data": "a"}, {"type": "stderr", "data": "E"}, {"type": "stdout", "data": "b"},
        {"type": "result", "exit_code": 0, "signal": None, "stdout_truncated": False,
         "stderr_truncated": False, "timed_out": False, "duration_ms": 1.0}]
    rec = Recorder(lambda r: ndjson(events))
    s = await connected(rec)
    seen: list[tuple[str, str]] = []

    async def on_err(data: str) -> None:
        seen.append(("err", data))

    res = await s.commands.run("echo a", on_stdout=lambda d: seen.append(("out", d)), on_stderr=on_err)
    assert seen == [("out", "a"), ("err", "E"), ("out", "b")]
    assert (res.stdout, res.stderr, res.exit_code) == ("ab", "E", 0)
    assert rec.requests[0].headers["accept"] == "application/x-ndjson"
    assert rec.json_body()["cmd"] == "echo a"
    await s.disconnect()


async def test_stream_error_event_raises_mapped_error() -> None:
    rec = Recorder(lambda r: ndjson([{"type": "stdout", "data": "x"},
                                     {"type": "error", "code": "session_failed", "detail": "vm gone"}]))
    s = await connected(rec)
    with pytest.raises(SessionFailed, match="vm gone"):
        await s.commands.run("x", on_stdout=lambda d: None)
    await s.disconnect()


async def test_stream_cut_before_result_is_a_connection_error() -> None:
    rec = Recorder(lambda r: ndjson([{"type": "stdout", "data": "x"}]))
    s = await connected(rec)
    with pytest.raises(CapsaConnectionError, match="ended before"):
        await s.commands.run("x", on_stdout=lambda d: None)
    await s.disconnect()


async def test_streaming_request_answered_with_plain_json_still_works() -> None:
    rec = Recorder(lambda r: httpx.Response(200, json={"exit_code": 0, "stdout": "all", "stderr": ""}))
    s = await connected(rec)
    got: list[str] = []
    res = await s.commands.run("x", on_stdout=got.append)
    assert got == ["all"] and res.stdout == "all"
    await s.disconnect()


async def test_background_process_wait_kill_and_output() -> None:
    polls = {"n": 0}

    def handler(r: httpx.Request) -> httpx.Response:
        path = r.url.path
        base = "/v1/sessions/ses_aaaaaaaaaaaaaaaaaaaa"
        proc = {"pid": 42, "cmd": ["sleep", "1"], "running": True, "exit_code": None, "signal": None,
                "started_at": NOW}
        if path == f"{base}/commands":
            return httpx.Response(201, json=proc)
        if path == f"{base}/processes/42/output":
            polls["n"] += 1
            done = polls["n"] >= 3
            return httpx.Response(200, json={"stdout": "x" * polls["n"], "stderr": "", "running": not done,
                                             "exit_code": 0 if done else None, "signal": None})
        if path == f"{base}/processes/42/kill":
            return httpx.Response(200, json={**proc, "running": False, "signal": 9})
        if path == f"{base}/processes":
            return httpx.Response(200, json={"items": [proc]})
        return httpx.Response(404, json={"code": "not_found", "detail": path})

    rec = Recorder(handler)
    s = await connected(rec)
    proc = await s.commands.run("sleep 1", background=True)
    assert proc.pid == 42 and proc.info.running
    assert rec.json_body()["background"] is True
    out = await proc.wait(poll_interval=0.01)
    assert (out.running, out.exit_code, out.stdout) == (False, 0, "xxx")
    killed = await proc.kill(9)
    assert rec.json_body() == {"signal": 9} and killed.signal == 9
    assert [p.pid for p in await s.commands.list()] == [42]
    await s.disconnect()


async def test_process_wait_times_out() -> None:
    rec = Recorder(lambda r: httpx.Response(200, json={"pid": 1, "running": True, "stdout": ""}))
    s = await connected(rec)
    info = ProcessInfo(pid=1, running=True, started_at=datetime.fromisoformat(NOW))
    proc = AsyncProcess(s.client, s.id, info)
    with pytest.raises(TimeoutError):
        await proc.wait(0.05, poll_interval=0.01)
    await s.disconnect()


async def test_files_write_read_list_stat_mkdir_remove() -> None:
    info = {"path": "/w/a.txt", "name": "a.txt", "type": "file", "size": 2, "mode": 0o644, "mtime": 1.5}

    def handler(r: httpx.Request) -> httpx.Response:
        p = r.url.path.rsplit("/files", 1)[1]
        if r.method == "PUT" and p == "/content":
            return httpx.Response(200, json=info)
        if r.method == "GET" and p == "/content":
            return httpx.Response(200, content=b"\x00\xffhi",
                                  headers={"content-type": "application/octet-stream"})
        if p == "/list":
            return httpx.Response(200, json={"items": [info, {**info, "name": "d", "type": "dir"}]})
        if p in ("/stat", "/mkdir"):
            return httpx.Response(200, json=info)
        if r.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(404, json={"code": "not_found", "detail": p})

    rec = Recorder(handler)
    s = await connected(rec)
    written = await s.files.write("/w/a.txt", "hé", mode=0o600)
    assert written.name == "a.txt"
    put = rec.requests[-1]
    assert put.url.params["path"] == "/w/a.txt" and put.url.params["mode"] == "600"
    assert rec.bodies[-1] == "hé".encode()
    assert await s.files.read_bytes("/w/a.txt") == b"\x00\xffhi"
    assert (await s.files.read("/w/a.txt", errors="replace")).endswith("hi")
    listing = await s.files.list("/w")
    assert [f.is_dir for f in listing] == [False, True]
    await s.files.mkdir("/w/new", parents=False)
    assert rec.requests[-1].url.params["parents"] == "false"
    await s.files.remove("/w", recursive=True)
    assert (rec.requests[-1].method, rec.requests[-1].url.params["recursive"]) == ("DELETE", "true")
    await s.disconnect()


async def test_upload_streams_a_local_file(tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    payload = bytes(range(256)) * 4096 * 3  # 3 MiB, more than one chunk
    src.write_bytes(payload)
    rec = Recorder(lambda r: httpx.Response(200, json={"path": "/x", "name": "x", "type": "file",
                                                        "size": len(payload), "mode": 420, "mtime": 0}))
    s = await connected(rec)
    info = await s.files.upload("/x", src)
    assert info.size == len(payload) and rec.bodies[-1] == payload
    # chunked transfer, not a single in-memory body with a Content-Length
    assert "content-length" not in rec.requests[-1].headers
    with pytest.raises(FileNotFoundError):
        await s.files.upload("/x", tmp_path / "missing")
    assert len(rec.requests) == 1  # nothing was sent for the missing file
    await s.disconnect()


async def test_download_is_atomic(tmp_path: Path) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"partial"
        raise httpx.RemoteProtocolError("peer closed")

    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.params["path"] == "/ok":
            return httpx.Response(200, content=b"complete")
        return httpx.Response(200, content=broken())

    rec = Recorder(handler)
    s = await connected(rec)
    dest = tmp_path / "out.bin"
    assert await s.files.download("/ok", dest) == 8 and dest.read_bytes() == b"complete"
    with pytest.raises(CapsaConnectionError):
        await s.files.download("/broken", tmp_path / "bad.bin")
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]  # no partial file left behind
    chunks = [c async for c in s.files.iter_bytes("/ok")]
    assert b"".join(chunks) == b"complete"
    await s.disconnect()


async def test_close_and_context_manager_release_the_connection() -> None:
    rec = Recorder(lambda r: httpx.Response(200, json=session_json(state="closed")))
    s = await connected(rec)
    async with s:
        pass
    assert rec.requests[-1].url.path.endswith("/close") and s.state == "closed"
    assert s.client._http.is_closed
    with pytest.raises(CapsaClientError, match=r"Session\.connect"):
        await s.commands.run("true")
    requests = len(rec.requests)
    assert (await s.close()).state == "closed"  # closing twice is harmless and sends nothing
    assert len(rec.requests) == requests


@pytest.mark.parametrize("body", [{"id": 5}, [], "text", {"items": "nope"}, None])
async def test_malformed_success_answers_raise_unexpected_response(body: Any) -> None:
    rec = Recorder(lambda r: httpx.Response(200, json=body))
    async with rec.client() as client:
        with pytest.raises(UnexpectedResponse):
            await client.get_session("ses_x")
        with pytest.raises(UnexpectedResponse):
            await client.list_sessions()

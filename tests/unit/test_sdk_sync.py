"""The blocking ``Session`` is the async implementation run on the SDK's loop thread: same requests, same
results, same errors, callbacks delivered, and Ctrl-C stops the request in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import capsa
from capsa.sdk import Client, NotFound, Process, Session
from capsa.sdk.portal import get_portal

NOW = "2026-11-30T04:00:00Z"
SID = "ses_bbbbbbbbbbbbbbbbbbbb"


def session_json(state: str = "running") -> dict[str, Any]:
    return {"id": SID, "tenant": "t1", "state": state, "template": "base", "created_at": NOW,
            "updated_at": NOW, "expires_at": NOW, "idle_timeout": None, "last_activity_at": NOW,
            "metadata": {"k": "v"}, "memory_mib": 256, "vcpus": 1, "node_id": "local",
            "failure_reason": None, "closed_at": None}


class FakeServer:
    """A scripted API: enough routes to drive one session through the blocking API."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.files: dict[str, bytes] = {}
        self.state = "running"
        self.cancelled = threading.Event()

    async def __call__(self, r: httpx.Request) -> httpx.Response:
        body = await r.aread()
        path = r.url.path.removeprefix(f"/v1/sessions/{SID}")
        self.calls.append((r.method, r.url.path))
        if r.url.path == "/v1/sessions" and r.method == "POST":
            return httpx.Response(201, json=session_json())
        if r.url.path.startswith("/v1/sessions/") and not r.url.path.startswith(f"/v1/sessions/{SID}"):
            return httpx.Response(404, json={"code": "not_found", "detail": "no such session", "status": 404})
        if path == "" and r.method == "GET":
            return httpx.Response(200, json=session_json(self.state))
        if path == "/close":
            self.state = "closed"
            return httpx.Response(200, json=session_json("closed"))
        if path == "/timeout":
            return httpx.Response(200, json=session_json())
        if path == "/commands":
            cmd = json.loads(body)
            if cmd["cmd"] == "hang":
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            if cmd["background"]:
                return httpx.Response(201, json={"pid": 7, "cmd": ["sleep"], "running": True,
                                                 "started_at": NOW})
            if r.headers.get("accept") == "application/x-ndjson":
                lines = [{"type": "stdout", "data": "one\n"}, {"type": "stderr", "data": "warn\n"},
                         {"type": "stdout", "data": "two\n"}, {"type": "result", "exit_code": 5}]
                content = "".join(json.dumps(x) + "\n" for x in lines).encode()
                return httpx.Response(200, content=content, headers={"content-type": "application/x-ndjson"})
            return httpx.Response(200, json={"exit_code": 0, "stdout": f"ran {cmd['cmd']}", "stderr": ""})
        if path == "/processes/7/output":
            return httpx.Response(200, json={"stdout": "done", "running": False, "exit_code": 0})
        if path == "/files/content" and r.method == "PUT":
            self.files[r.url.params["path"]] = body
            return httpx.Response(200, json={"path": r.url.params["path"], "name": "f", "type": "file",
                                             "size": len(body), "mode": 420, "mtime": 0.0})
        if path == "/files/content" and r.method == "GET":
            data = self.files.get(r.url.params["path"])
            if data is None:
                return httpx.Response(404, json={"code": "not_found", "detail": "no such file"})
            return httpx.Response(200, content=data)
        return httpx.Response(404, json={"code": "not_found", "detail": f"no route {r.method} {path}"})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def test_top_level_package_reexports_the_sdk() -> None:
    assert capsa.Session is Session
    assert capsa.AsyncSession.__name__ == "AsyncSession"
    assert issubclass(capsa.NotFound, capsa.CapsaAPIError)
    with pytest.raises(AttributeError):
        _ = capsa.DoesNotExist


def test_blocking_session_round_trip(tmp_path: Path) -> None:
    server = FakeServer()
    with Session.create(timeout=60, metadata={"k": "v"}, api_url="http://capsa.test", api_key="k",
                        transport=server.transport()) as s:
        assert s.id == SID and s.info.metadata == {"k": "v"}
        assert s.commands.run("echo hi").stdout == "ran echo hi"
        s.files.write("/tmp/a", b"\x00bin")
        assert s.files.read_bytes("/tmp/a") == b"\x00bin"
        src = tmp_path / "up"
        src.write_bytes(b"x" * 600_000)
        assert s.files.upload("/tmp/up", src).size == 600_000
        assert b"".join(s.files.iter_bytes("/tmp/up", chunk_size=100_000)) == b"x" * 600_000
        assert s.files.download("/tmp/up", tmp_path / "down") == 600_000
        with pytest.raises(NotFound, match="no such file"):
            s.files.read("/nope")
        assert s.set_timeout(100).id == SID
        assert s.refresh().state == "running"
    assert s.state == "closed"
    assert ("POST", f"/v1/sessions/{SID}/close") in server.calls


def test_streaming_callbacks_run_on_the_sdk_thread() -> None:
    server = FakeServer()
    seen: list[tuple[str, str, str]] = []
    with Session.create(api_url="http://capsa.test", api_key="k", transport=server.transport()) as s:
        def record(kind: str) -> Any:
            return lambda d: seen.append((kind, d, threading.current_thread().name))

        res = s.commands.run("x", on_stdout=record("out"), on_stderr=record("err"))
    assert [(k, d) for k, d, _ in seen] == [("out", "one\n"), ("err", "warn\n"), ("out", "two\n")]
    assert {t for _, _, t in seen} == {"capsa-sdk-loop"}
    assert (res.exit_code, res.stdout, res.stderr) == (5, "one\ntwo\n", "warn\n")


def test_nested_blocking_call_from_callback_is_refused() -> None:
    server = FakeServer()
    s = Session.create(api_url="http://capsa.test", api_key="k", transport=server.transport())
    with s, pytest.raises(RuntimeError, match="AsyncSession"):
        s.commands.run("x", on_stdout=lambda d: s.refresh())


def test_background_process_blocking() -> None:
    server = FakeServer()
    with Session.create(api_url="http://capsa.test", api_key="k", transport=server.transport()) as s:
        proc = s.commands.run("sleep 1", background=True)
        assert isinstance(proc, Process) and proc.pid == 7
        out = proc.wait(5)
        assert (out.running, out.exit_code, out.stdout) == (False, 0, "done")


def test_connect_and_list_and_errors() -> None:
    server = FakeServer()
    with Client("http://capsa.test", "k", transport=server.transport()) as client:
        s = Session.connect(SID, client=client)
        assert s.state == "running"
        s.disconnect()  # a shared client stays open
        with pytest.raises(NotFound):
            Session.connect("ses_nobody", client=client)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs main thread")
def test_ctrl_c_cancels_the_request_in_flight() -> None:
    server = FakeServer()
    s = Session.create(api_url="http://capsa.test", api_key="k", transport=server.transport())
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            s.commands.run("hang")
    finally:
        timer.cancel()
    assert server.cancelled.wait(5), "the request kept running after Ctrl-C"
    s.close()


def test_one_loop_thread_per_process() -> None:
    assert get_portal() is get_portal()
    names = [t.name for t in threading.enumerate()].count("capsa-sdk-loop")
    assert names == 1

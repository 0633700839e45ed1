"""schemathesis against the served OpenAPI document: whatever it sends, the API never answers 5xx and
every error is problem+json. Runs the real stack (uvicorn, node agent, guest daemons as host processes)."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from capsa.node.agent.capacity import NodeCapacity
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

# Tar bodies are generated as arbitrary bytes, like octet-stream ones (garbage must give 4xx, never 5xx).
schemathesis.serializer.alias("application/x-tar", "application/octet-stream")


class _StackThread:
    """The async stack on its own loop in a thread, because schemathesis' pytest tests are synchronous."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.stack: ApiStack | None = None
        self.user_key = ""
        self.session_id = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            stack = ApiStack(
                f"sqlite+aiosqlite:///{self.root}/capsa.db",
                FakeRuntime(),
                fake_image(self.root / "image"),
                # Room for what the fuzzer makes: the fake runtime snapshots, so generated branches of the
                # live session really start up to 32 guest daemons each (a run peaks around 60).
                capacity=NodeCapacity(10**7, 10**5, 1000),
                # A secrets key, so the secrets routes are exercised (without one they answer 503).
                settings={"session_create_limit": 40,
                          "secret_key": base64.b64encode(os.urandom(32)).decode()},
            )
            self.stack = await stack.start()
            self.user_key = await stack.tenant_key("fuzz")
            async with stack.client(self.user_key) as client:
                response = await client.post("/v1/sessions", json={"timeout": 3600})
                response.raise_for_status()
                self.session_id = response.json()["id"]
        except BaseException as exc:
            self.error = exc
            self.ready.set()
            raise
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            await stack.stop()

    def start(self) -> None:
        self._thread.start()
        self.ready.wait(60)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_StackThread]:
    thread = _StackThread(tmp_path_factory.mktemp("fuzz"))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
        assert thread.stack is not None and thread.stack.runtime.list() == []


def _check(case: Any, stack: _StackThread, seen: dict[int, int]) -> None:
    assert stack.stack is not None
    # Aim half of the requests at a real session so they reach the node and the guest daemon.
    # (not the routes that would end it early: close, delete, shorten its timeout).
    ending = case.path.endswith(("/close", "/timeout")) or (
        case.method == "DELETE" and case.path.count("/") == 3
    )
    # Generated commands and file operations run on the host with the fake runtime: only when its daemons
    # are confined (root: namespaces, nobody, private tmpfs) may they reach a real session.
    confined = bool(getattr(stack.stack.runtime, "confine", False))
    # A watch or a process's output stream is meant to stay open (a watch until the client leaves): read
    # its answer's head, check it, and leave; everything else is read whole.
    follows = case.method == "GET" and case.path.endswith(("/files/watch", "/processes/{pid}/stream"))
    if (
        confined
        and "session_id" in (case.path_parameters or {})
        and not ending
        # crc32, not hash(): str hashes change with PYTHONHASHSEED, so hash() made the choice differ per run.
        # Streams always go to the live session, so the open-ended answer is exercised every run.
        and (follows or zlib.crc32(repr((case.body, case.query)).encode()) % 2 == 0)
    ):
        case.path_parameters["session_id"] = stack.session_id
    key = stack.stack.admin_key if case.path.startswith(("/v1/keys", "/v1/nodes")) else stack.user_key
    try:
        headers = {"Authorization": f"Bearer {key}"}
        if follows:
            # schemathesis reads every body whole (only text/event-stream is cut short), so these go
            # through requests with stream=True.
            response = requests.request(**case.as_transport_kwargs(base_url=stack.stack.url, headers=headers),
                                        stream=True, timeout=60)
            if response.status_code == 200:
                assert response.headers["content-type"].startswith("application/x-ndjson"), response.headers
                response.close()
                seen[200] = seen.get(200, 0) + 1
                return
        else:
            response = case.call(base_url=stack.stack.url, headers=headers, timeout=60)
    except requests.exceptions.ChunkedEncodingError:
        # A download that fails after its 200 has been sent (e.g. a tar of "/" meets an unreadable
        # directory) can only be reported by aborting the stream; only streamed downloads may do that.
        assert case.method == "GET" and case.path.endswith(("/files/archive", "/files/content")), case.path
        seen[-1] = seen.get(-1, 0) + 1
        return
    seen[response.status_code] = seen.get(response.status_code, 0) + 1
    content_type = response.headers.get("content-type") or [""]
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    # The port proxy answers 502 when nothing in the sandbox listens on the generated port: the gateway's
    # honest answer, not a server error; every other 5xx is.
    proxied = "/ports/{port}/{path}" in case.path
    if response.status_code == 502 and proxied:
        assert content_type.startswith("application/problem+json"), response.text
        if case.method != "HEAD":
            assert response.json()["code"] in ("port_unreachable", "port_protocol_error"), response.text
        return
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert content_type.startswith("application/problem+json"), response.text
        if case.method == "HEAD":
            return  # an answer to HEAD has no body
        body = response.json()
        assert isinstance(body.get("code"), str) and body["status"] == response.status_code


@pytest.mark.timeout(900)
def test_no_server_errors(running_stack: _StackThread) -> None:
    assert running_stack.stack is not None
    schema = schemathesis.openapi.from_url(running_stack.stack.url + "/openapi.json")
    seen: dict[int, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 25
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: Any) -> None:
            _check(case, running_stack, seen)

        run()
    # The fuzzing reached real work, not only validation errors.
    assert seen.get(200, 0) + seen.get(201, 0) > 50, seen
    if not getattr(running_stack.stack.runtime, "confine", False):
        print("fake runtime not confined (not root): generated commands were kept away from live sessions")
    print("status codes seen:", dict(sorted(seen.items())))


def test_schema_is_served(running_stack: _StackThread) -> None:
    assert running_stack.stack is not None
    spec = httpx.get(running_stack.stack.url + "/openapi.json").json()
    assert spec["info"]["title"] == "capsa"

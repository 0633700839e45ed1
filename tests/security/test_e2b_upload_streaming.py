"""Issue 27, M5: E2B multipart uploads (envd ``POST /files``) were spooled whole to a temporary file before
any size check. A chunked multipart upload far past ``max_file_bytes`` is now refused, read only up to the
bound, and nothing of it is spooled; an upload within the bound still lands whole. Against the real
control plane (fake runtime, no VM), through httpx's ASGI transport into the app uvicorn serves.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.api_stack import ApiStack
from tests.support.control_db import sqlite_url
from tests.support.counted_body import CHUNK, CountedBody, send_counted
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
ATTACK = 300 * MIB
BOUND = 8 * MIB


def _spooled_bytes(directory: str) -> int:
    """The largest unlinked temporary file this process holds open in ``directory``: a spooled upload
    (Starlette's form parser rolls a part over to ``tempfile.TemporaryFile``, which has no name)."""
    largest = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.dirname(target) == directory and target.endswith(" (deleted)"):
                largest = max(largest, os.stat(f"/proc/self/fd/{fd}").st_size)
        except OSError:
            continue
    return largest


class Watched(CountedBody):
    """A body that looks, before each chunk it hands out, for spooled files in the temporary directory."""

    def __init__(self, size: int, first: bytes) -> None:
        super().__init__(size, first)
        self.spool = tempfile.gettempdir()
        self.spooled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in super().__aiter__():
            self.spooled = max(self.spooled, _spooled_bytes(self.spool))
            yield chunk


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ApiStack]:
    async with ApiStack(sqlite_url(tmp_path), FakeRuntime(), fake_image(tmp_path / "image"),
                        settings={"max_file_bytes": BOUND}) as started:
        yield started


async def test_a_chunked_multipart_upload_past_the_bound_is_never_spooled(stack: ApiStack) -> None:
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        created = await client.post("/v1/sessions", json={"template": "base"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
    head = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/big.bin\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n")
    body = Watched(ATTACK, head)
    response = await send_counted(stack.replicas[0].app, "POST", "/e2b/envd/files", body, declared=False,
                                  headers={"x-access-token": key, "e2b-sandbox-id": sid,
                                           "content-type": "multipart/form-data; boundary=b0undary"})
    print(f"E2B multipart upload of {ATTACK // MIB} MiB: {body.pulled / MIB:.1f} MiB read, "
          f"largest spooled file {body.spooled} bytes")
    assert body.spooled == 0, f"{body.spooled} bytes spooled to {body.spool}"
    assert body.pulled <= BOUND + 2 * CHUNK
    assert response.status_code == 413, response.text
    # An upload within the bound (multipart, as the e2b SDK sends it) still lands whole.
    async with stack.client(key) as client:
        files = {"file": ("/tmp/small.bin", b"y" * (3 * MIB), "application/octet-stream")}
        written = await client.post("/e2b/envd/files", files=files,
                                    headers={"x-access-token": key, "e2b-sandbox-id": sid})
        assert written.status_code == 200, written.text
        assert written.json()[0]["path"] == "/tmp/small.bin"
        read = await client.get(f"/v1/sessions/{sid}/files/content", params={"path": "/tmp/small.bin"})
        assert read.content == b"y" * (3 * MIB)

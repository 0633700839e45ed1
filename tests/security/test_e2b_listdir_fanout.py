"""Issue 27 (low): one E2B ``ListDir`` cannot fan out into thousands of node calls. Against the real control
plane and node agent (fake runtime, real HTTP), a tree needing more than :data:`MAX_LISTINGS` directory
listings is refused with ``resource_exhausted`` after at most that many node calls; a smaller one is served.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from capsa.compat.e2b import MOUNT_PATH
from capsa.compat.e2b.filesystem import MAX_LISTINGS
from capsa.node.agent.guest import SandboxGuest
from tests.support.api_stack import ApiStack

pytestmark = pytest.mark.timeout(300)

_TREE = "/tmp/tree"
_TOP, _SUB = 40, 30
"""40 directories of 30: depth 2 takes 41 listings, depth 3 takes 1,241 (more than MAX_LISTINGS)."""


async def test_a_deep_listdir_is_refused_within_the_listing_cap(stack: ApiStack,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert 1 + _TOP < MAX_LISTINGS < 1 + _TOP + _TOP * _SUB
    key = await stack.tenant_key("lister")
    async with stack.client(key) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        script = (f'set --; for i in $(seq {_TOP}); do for j in $(seq {_SUB}); do '
                  f'set -- "$@" {_TREE}/d$i/e$j; done; done; mkdir -p "$@"')
        made = await client.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["sh", "-c", script]})
        assert made.json()["exit_code"] == 0, made.text

    assert stack.agent is not None
    calls = [0]
    real_list_dir = SandboxGuest.list_dir

    async def counted_list_dir(self: SandboxGuest, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real_list_dir(self, *args, **kwargs)

    monkeypatch.setattr(SandboxGuest, "list_dir", counted_list_dir)

    async with httpx.AsyncClient(base_url=stack.url + MOUNT_PATH + "/envd", timeout=120, headers={
            "X-Access-Token": key, "E2b-Sandbox-Id": sid}) as envd:
        shallow = await envd.post("/filesystem.Filesystem/ListDir", json={"path": _TREE, "depth": 2})
        assert shallow.status_code == 200, shallow.text
        assert len(shallow.json()["entries"]) == _TOP + _TOP * _SUB
        assert calls[0] == 1 + _TOP

        calls[0] = 0
        deep = await envd.post("/filesystem.Filesystem/ListDir", json={"path": _TREE, "depth": 3})
    print(f"depth 3: HTTP {deep.status_code} after {calls[0]} node listings")
    assert deep.status_code == 429 and deep.json()["code"] == "resource_exhausted", deep.text[:300]
    assert f"more than {MAX_LISTINGS} directories" in deep.json()["message"]
    assert calls[0] <= MAX_LISTINGS

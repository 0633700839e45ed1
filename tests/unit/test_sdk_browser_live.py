"""``s.browser(interactive=...)`` in the async and the blocking SDK: the flag becomes the
``interactive=true`` query parameter of ``GET /v1/sessions/{id}/browser`` (the interactive live view of a
desktop), and is left out otherwise."""

from __future__ import annotations

from typing import Any

import httpx

from capsa.sdk import AsyncSession, Session

NOW = "2026-12-01T16:00:00Z"
SID = "ses_dddddddddddddddddddd"


def _session() -> dict[str, Any]:
    return {"id": SID, "tenant": "t1", "state": "running", "template": "desktop", "created_at": NOW,
            "updated_at": NOW, "expires_at": NOW, "idle_timeout": None, "last_activity_at": NOW,
            "metadata": {}, "memory_mib": 1024, "vcpus": 1, "node_id": "local", "failure_reason": None,
            "closed_at": None}


class _Api:
    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, r: httpx.Request) -> httpx.Response:
        if r.url.path == "/v1/sessions" and r.method == "POST":
            return httpx.Response(201, json=_session())
        if r.url.path == f"/v1/sessions/{SID}/browser":
            query = r.url.query.decode()
            self.queries.append(query)
            port = 6080 if query == "interactive=true" else 6081
            return httpx.Response(200, json={"cdp_url": "ws://x/cdp",
                                             "live_url": f"http://x/ports/{port}/vnc.html"})
        return httpx.Response(200, json=_session())


async def test_async_browser_interactive_flag() -> None:
    api = _Api()
    async with await AsyncSession.create("desktop", api_url="http://capsa.test", api_key="k",
                                         transport=httpx.MockTransport(api)) as s:
        assert (await s.browser()).live_url == "http://x/ports/6081/vnc.html"
        assert (await s.browser(interactive=True)).live_url == "http://x/ports/6080/vnc.html"
        assert (await s.browser_info(interactive=False)).live_url == "http://x/ports/6081/vnc.html"
    assert api.queries == ["", "interactive=true", ""]


def test_blocking_browser_interactive_flag() -> None:
    api = _Api()
    with Session.create("desktop", api_url="http://capsa.test", api_key="k",
                        transport=httpx.MockTransport(api)) as s:
        assert s.browser(interactive=True).live_url == "http://x/ports/6080/vnc.html"
        assert s.browser_info().live_url == "http://x/ports/6081/vnc.html"
    assert api.queries == ["interactive=true", ""]

"""Issue 27 (low): traffic on a port token was not chained (only the API key's was): a request on a token
is now an ``api`` event of the token's tenant whose ``key_id`` is the token's id. Real control plane and node
(fake runtime)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def stack(db_url: str, tmp_path: Path) -> AsyncIterator[ApiStack]:
    async with ApiStack(db_url, FakeRuntime(), fake_image(tmp_path / "image")) as s:
        yield s


async def test_port_token_traffic_is_chained(stack: ApiStack) -> None:
    key = await stack.tenant_key("port-audit")
    async with stack.client(key) as client:
        made = await client.post("/v1/sessions", json={})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        token = await client.post(f"/v1/sessions/{sid}/ports/8080/tokens", json={})
        assert token.status_code in (200, 201), token.text
        token_id, secret = token.json()["id"], token.json()["token"]
    async with stack.client(None) as anonymous:
        # Nothing listens on 8080 in the fake guest: the answer is an error, but the token was used.
        used = await anonymous.get(f"/v1/sessions/{sid}/ports/8080/", headers={"X-Capsa-Port-Token": secret})
        assert used.status_code != 401, used.text
    async with stack.client(key) as client:
        chain = (await client.get("/v1/audit", params={"kind": "api", "limit": 1000})).json()["items"]
        assert (await client.get("/v1/audit/verify")).json()["ok"]
    api = [e for e in chain if e["key_id"] == token_id]
    assert len(api) == 1 and api[0]["session_id"] == sid, api
    assert api[0]["detail"]["path"] == f"/v1/sessions/{sid}/ports/8080/"

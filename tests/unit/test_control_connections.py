"""Connections in the control plane against a local OAuth 2.0 server (authlib's server side, on loopback):
a provider registered by discovery, a sign-in by authorization code with PKCE through capsa's callback (the
test plays the browser), a device sign-in, refresh in the control plane (20 concurrent callers with an
expired token: one refresh at the provider), revocation at the provider, no credential in any answer, and
the node token route serving only sessions on that node. The broker side is in
tests/unit/test_egress_connections_loopback.py."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from capsa.control.connections.tokens import current_token
from capsa.control.errors import ApiError
from capsa.control.plane import ControlPlane
from capsa.control.store.connection_models import ConnectionRow
from tests.support.api_stack import ApiStack
from tests.support.oauth_server import CLIENT_ID, CLIENT_SECRET, OAuthLab, start_oauth_server

KEY = base64.b64encode(os.urandom(32)).decode()
SETTINGS = {"secret_key": KEY, "oauth_allow_networks": ["127.0.0.0/8"]}
"""The lab provider is on loopback: the operator's allow-list lets the control plane reach it."""


@pytest.fixture
async def lab() -> AsyncIterator[OAuthLab]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    lab = await start_oauth_server(sock, f"http://127.0.0.1:{sock.getsockname()[1]}", expires_in=3600)
    yield lab
    await lab.stop()


async def _signed_in(stack: ApiStack, api: httpx.AsyncClient, lab: OAuthLab, name: str = "gh") -> str:
    created = await api.post("/v1/connection-providers", json={
        "name": "lab", "issuer": lab.base_url, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
        "scopes": ["repo"]})
    assert created.status_code in (201, 409), created.text
    conn = await api.post("/v1/connections", json={"name": name, "provider": "lab"})
    assert conn.status_code == 201, conn.text
    assert conn.json()["state"] == "pending"
    login = await api.post(f"/v1/connections/{name}/login", json={"mode": "code"})
    assert login.status_code == 200, login.text
    url = login.json()["authorization_url"]
    query = parse_qs(urlsplit(url).query)
    assert query["code_challenge_method"] == ["S256"] and query["client_id"] == [CLIENT_ID]
    # The browser: the authorization server consents at once and redirects to capsa's callback.
    async with httpx.AsyncClient() as browser:
        to_callback = await browser.get(url)
        assert to_callback.status_code == 302
        callback = to_callback.headers["location"]
        assert callback.startswith(stack.url + "/v1/connections/callback?")
        done = await browser.get(callback)
        assert done.status_code == 200 and "is active" in done.text
        again = await browser.get(callback)  # single use
        assert again.status_code == 400 and again.json()["code"] == "login_state_invalid"
    return str(conn.json()["id"])


async def test_code_sign_in_refresh_single_flight_and_revocation(
        make_stack: Callable[..., Awaitable[ApiStack]], lab: OAuthLab) -> None:
    stack = await make_stack(settings=SETTINGS)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as api:
        conn_id = await _signed_in(stack, api, lab)
        listed = await api.get("/v1/connections")
        assert listed.status_code == 200
        [item] = listed.json()["items"]
        assert item["state"] == "active" and item["id"] == conn_id and item["scopes"] == ["repo"]
        providers = (await api.get("/v1/connection-providers")).json()["items"]
        assert providers[0]["token_endpoint"] == lab.base_url + "/token" and providers[0]["has_client_secret"]
        text = listed.text + (await api.get("/v1/connection-providers")).text
        for credential in lab.all_secrets():
            assert credential not in text

        plane = stack.plane
        first = await current_token(plane, conn_id)
        assert first.access_token in lab.tokens and lab.refreshes == 0  # fresh from the sign-in
        # The token expires (the row says so): 20 concurrent callers, one refresh at the provider.
        async with plane.db() as db:
            row = await db.get(ConnectionRow, conn_id)
            assert row is not None
            row.access_expires_at = 0.0
            await db.commit()
        lab.refresh_delay = 0.3
        answers = await asyncio.gather(*(current_token(plane, conn_id) for _ in range(20)))
        assert lab.refreshes == 1
        assert {a.access_token for a in answers} == {answers[0].access_token} != {first.access_token}
        assert (await api.get(f"/v1/connections/{conn_id}")).json()["refreshes"] == 1

        # Two replicas asked at once for a token that is due: the refresh lease lets one refresh.
        replica = await stack.add_replica()
        other: ControlPlane = replica.app.state.plane
        async with plane.db() as db:
            row = await db.get(ConnectionRow, conn_id, populate_existing=True)
            assert row is not None
            row.access_expires_at = 0.0
            await db.commit()
        answers = await asyncio.gather(*(current_token(p, conn_id) for p in [plane, other] * 10))
        assert lab.refreshes == 2 and len({a.access_token for a in answers}) == 1

        revoked = await api.post("/v1/connections/gh/revoke")
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["provider_revoked"] is True
        assert revoked.json()["connection"]["state"] == "revoked"
        assert lab.revocations == 2 and lab.live_access_tokens() == []  # refresh and access token
        refused = await api.post("/v1/connections/gh/revoke")
        assert refused.status_code == 409 and refused.json()["code"] == "connection_revoked"
        with pytest.raises(ApiError, match="revoked"):
            await current_token(plane, conn_id)


async def test_device_sign_in(make_stack: Callable[..., Awaitable[ApiStack]], lab: OAuthLab) -> None:
    stack = await make_stack(settings=SETTINGS)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as api:
        assert (await api.post("/v1/connection-providers", json={
            "name": "lab", "token_endpoint": lab.base_url + "/token",
            "device_authorization_endpoint": lab.base_url + "/device_authorization",
            "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET})).status_code == 201
        assert (await api.post("/v1/connections", json={"name": "tv", "provider": "lab"})).status_code == 201
        login = (await api.post("/v1/connections/tv/login", json={"mode": "device"})).json()
        assert login["user_code"] and login["verification_uri"] == lab.base_url + "/device"
        poll = await api.post(f"/v1/connections/tv/logins/{login['login_id']}/poll")
        assert poll.status_code == 200 and poll.json()["status"] == "pending"
        async with httpx.AsyncClient() as person:
            await person.post(lab.base_url + "/device/approve", data={"user_code": login["user_code"]})
        poll = await api.post(f"/v1/connections/tv/logins/{login['login_id']}/poll")
        assert poll.status_code == 200, poll.text
        assert poll.json()["status"] == "connected" and poll.json()["connection"]["state"] == "active"
        # A code sign-in is refused for a provider without an authorization endpoint.
        refused = await api.post("/v1/connections/tv/login", json={"mode": "code"})
        assert refused.status_code == 409 and refused.json()["code"] == "login_unsupported"


async def test_node_token_route_serves_only_sessions_on_that_node(
        make_stack: Callable[..., Awaitable[ApiStack]], lab: OAuthLab) -> None:
    stack = await make_stack(settings=SETTINGS)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as api:
        conn_id = await _signed_in(stack, api, lab)
        session = await api.post("/v1/sessions", json={})
        assert session.status_code == 201, session.text
        sid = session.json()["id"]
    async with stack.client(stack.node_token) as node:
        # The session runs here but its policy binds no connection (it has none).
        refused = await node.post(f"/v1/nodes/{stack.node_id}/connections/{conn_id}/token",
                                  json={"session_id": sid})
        assert refused.status_code == 403, refused.text
        assert "access_token" not in refused.text
        other = await node.post(f"/v1/nodes/other-node/connections/{conn_id}/token", json={"session_id": sid})
        assert other.status_code in (401, 403, 404)


async def test_policy_refers_to_connections_by_name_and_refuses_unknown_ones(
        make_stack: Callable[..., Awaitable[ApiStack]], lab: OAuthLab) -> None:
    stack = await make_stack(settings=SETTINGS)
    key = await stack.tenant_key("acme")
    async with stack.client(key) as api:
        unknown = await api.post("/v1/sessions", json={"policy": {
            "domains": [{"domain": "api.example.com"}],
            "connections": [{"connection": "nope", "domains": ["api.example.com"]}]}})
        assert unknown.status_code == 422 and "nope" in unknown.text


async def test_cli_add_login_ls_revoke(make_stack: Callable[..., Awaitable[ApiStack]], lab: OAuthLab) -> None:
    from click.testing import CliRunner

    from capsa.cli.main import cli

    stack = await make_stack(settings=SETTINGS)
    env = {"CAPSA_API_URL": stack.url, "CAPSA_API_KEY": await stack.tenant_key("acme"),
           "LAB_SECRET": CLIENT_SECRET}

    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
        return result.exit_code, result.output

    code, out = await asyncio.to_thread(run, "connections", "add", "gh", "--issuer", lab.base_url,
                                        "--client-id", CLIENT_ID, "--client-secret-from-env", "LAB_SECRET",
                                        "--scope", "repo")
    assert code == 0, out
    code, out = await asyncio.to_thread(run, "connections", "login", "gh", "--no-browser", "--no-wait")
    assert code == 0, out
    url = next(line for line in out.splitlines() if line.startswith(lab.base_url + "/authorize?"))
    async with httpx.AsyncClient(follow_redirects=True) as browser:
        assert (await browser.get(url)).status_code == 200
    code, out = await asyncio.to_thread(run, "connections", "ls", "--json")
    assert code == 0 and '"state": "active"' in out
    for credential in lab.all_secrets():
        assert credential not in out
    code, out = await asyncio.to_thread(run, "connections", "revoke", "gh")
    assert code == 0, out
    code, out = await asyncio.to_thread(run, "connections", "revoke", "gh")
    assert code == 1 and out.count("\n") == 1 and "revoked" in out


async def test_sdk_sign_in_waits_for_the_callback(make_stack: Callable[..., Awaitable[ApiStack]],
                                                 lab: OAuthLab) -> None:
    from capsa.sdk import AsyncClient

    stack = await make_stack(settings=SETTINGS)
    async with AsyncClient(stack.url, await stack.tenant_key("acme")) as client:
        await client.connection_providers.create("lab", client_id=CLIENT_ID, client_secret=CLIENT_SECRET,
                                                 issuer=lab.base_url)
        await client.connections.create("gh", "lab")
        for _ in range(2):  # a second sign-in must wait for its own callback, not return at once
            before = (await client.connections.get("gh")).connected_at
            login = await client.connections.login("gh")
            assert login.authorization_url is not None
            waiting = asyncio.create_task(client.connections.wait_until_active(
                "gh", after=before, deadline=30, interval=0.1))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            async with httpx.AsyncClient(follow_redirects=True) as browser:
                assert (await browser.get(login.authorization_url)).status_code == 200
            info = await waiting
            assert info.state == "active" and info.connected_at is not None
            assert before is None or info.connected_at > before
        assert lab.issued == 2


async def test_sdk_device_sign_in_polls_until_approved(make_stack: Callable[..., Awaitable[ApiStack]],
                                                       lab: OAuthLab) -> None:
    from capsa.sdk import AsyncClient

    stack = await make_stack(settings=SETTINGS)
    async with AsyncClient(stack.url, await stack.tenant_key("acme")) as client:
        await client.connection_providers.create("lab", client_id=CLIENT_ID, client_secret=CLIENT_SECRET,
                                                 issuer=lab.base_url)
        await client.connections.create("tv", "lab")
        login = await client.connections.login("tv", device=True)
        waiting = asyncio.create_task(client.connections.wait_for_device("tv", login, deadline=30))
        await asyncio.sleep(1.5)  # at least one poll answered "pending"
        assert not waiting.done()
        async with httpx.AsyncClient() as person:
            await person.post(lab.base_url + "/device/approve", data={"user_code": login.user_code})
        info = await waiting
        assert info.state == "active" and lab.issued == 1

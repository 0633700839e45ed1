"""Issue 27, M6 and the port-token / CDP low findings, attacked through the real control plane and node
agent (fake runtime: the apps "in the sandbox" are host processes on loopback, real uvicorn servers):

- M6: on the API's path route, a hostile app's cookies for other paths or domains, ``Clear-Site-Data``,
  ``Service-Worker-Allowed`` and the other origin-wide policies are dropped and ``Referrer-Policy:
  no-referrer`` is set; with ``CAPSA_PORTS_DOMAIN`` each port is served on ``<port>-<session>.<domain>``,
  routed by ``Host`` to that session alone (a token of session A opens nothing of B's, API routes are not
  served there), and the API answers such URLs.
- Port tokens expire, are listed and revoked (any port), and over-long lifetimes are refused.
- Port tokens do not reach the server's logs (WebSocket handshake lines, noVNC's URL-encoded ``path=``).
- The CDP download rewrite holds against a ``\\u0042`` escape, ``Target.sendMessageToTarget``, repeated
  keys, and the raw tunnel (refused to port tokens on the CDP port).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
import uvicorn
from sqlalchemy import update
from sqlalchemy.ext.asyncio import create_async_engine

from capsa.common.port_tunnel import open_tunnel
from capsa.common.service import QuietServer, wait_started
from capsa.common.websocket import SocketStream, WebSocketClient, WebSocketRejected
from capsa.control.browser.cdp import CDP_PORT, DOWNLOADS_DIR, pin_downloads
from capsa.control.store.models import PortTokenRow, utcnow
from capsa.frontends import build_app
from tests.support import port_app
from tests.support.api_stack import ApiStack
from tests.support.fake_runtime import FakeRuntime, fake_image
from tests.support.logs import configured
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(180)

MakeStack = Callable[..., Awaitable[ApiStack]]
DOMAIN = "ports.test"


@pytest.fixture
async def make_stack(db_url: str, tmp_path: Path) -> AsyncIterator[MakeStack]:
    stacks: list[ApiStack] = []

    async def factory(**kwargs: Any) -> ApiStack:
        stack = ApiStack(db_url, FakeRuntime(), fake_image(tmp_path / "image"), **kwargs)
        stacks.append(stack)
        return await stack.start()

    try:
        yield factory
    finally:
        for s in stacks:
            await s.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def new_session(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/sessions", json={})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def start_app(client: httpx.AsyncClient, session_id: str, port: int) -> None:
    """The test app (tests/support/port_app.py) in the sandbox on ``port``, reachable through the proxy."""
    put = await client.put(f"/v1/sessions/{session_id}/files/content", params={"path": "/tmp/port_app.py"},
                           content=port_app.SOURCE.encode())
    assert put.status_code == 200, put.text
    started = await client.post(f"/v1/sessions/{session_id}/commands",
                                json={"cmd": f"exec python3 /tmp/port_app.py {port}", "background": True})
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 30
    while (await client.get(f"/v1/sessions/{session_id}/ports/{port}/hello")).status_code != 200:
        assert time.monotonic() < deadline, "the app in the sandbox did not come up"
        await asyncio.sleep(0.1)


async def ws_connect(url: str, host: str, target: str,
                     headers: list[tuple[str, str]] | None = None) -> WebSocketClient:
    where = urlsplit(url)
    stream = await SocketStream.connect(where.hostname or "127.0.0.1", where.port or 80)
    return await WebSocketClient.connect(stream, host, target, headers=headers or [])


def cookies_of(response: httpx.Response) -> dict[str, str]:
    return {v.split("=", 1)[0]: v for v in response.headers.get_list("set-cookie")}


# --- M6: the path route on the API's origin -------------------------------------------------------------


async def test_path_route_drops_what_acts_on_the_api_origin_and_sets_no_referrer(
        make_stack: MakeStack) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
        token = (await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")).json()["token"]
    prefix = f"/v1/sessions/{sid}/ports/{port}"
    async with stack.client(None) as browser:
        answer = await browser.get(f"{prefix}/hostile", params={"token": token},
                                   headers={"Referer": f"{stack.url}{prefix}/?token={token}&page=2"})
    assert answer.status_code == 200 and answer.text == "ok"
    cookies = cookies_of(answer)
    # Kept: the app's cookies for its own path; the proxy's token cookie for the port's path.
    assert cookies["own"] == "own=1" and cookies["scoped"] == f"scoped=1; Path={prefix}/app"
    assert cookies["capsa_port_token"].startswith(f"capsa_port_token={token}; Path={prefix}/;")
    # Dropped: cookies for the API's paths, for the whole host, origin-wide prefixes, and the app's own
    # attempt to plant a port token.
    assert not {"root", "api", "domain", "__Host-x"} & set(cookies)
    assert "cpt_attacker" not in str(answer.headers.get_list("set-cookie"))
    for name in ("clear-site-data", "service-worker-allowed", "strict-transport-security", "nel",
                 "report-to", "alt-svc"):
        assert name not in answer.headers, name
    assert answer.headers.get_list("referrer-policy") == ["no-referrer"]
    assert answer.headers["x-kept"] == "yes"
    # The token does not reach the app through the Referer either.
    assert token not in answer.headers["x-referer"] and "page=2" in answer.headers["x-referer"]


# --- M6: ports on hosts of their own ----------------------------------------------------------------------


async def test_ports_domain_serves_each_session_port_on_its_own_host(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"ports_domain": DOMAIN})
    key = await stack.tenant_key("acme")
    other_key = await stack.tenant_key("globex")
    port_a, port_b = free_port(), free_port()
    async with stack.client(key) as client:
        a = await new_session(client)
        await start_app(client, a, port_a)
        made = (await client.post(f"/v1/sessions/{a}/ports/{port_a}/tokens")).json()
    async with stack.client(other_key) as client:
        b = await new_session(client)
        await start_app(client, b, port_b)
        made_b = (await client.post(f"/v1/sessions/{b}/ports/{port_b}/tokens")).json()
    host_a, host_b = f"{port_a}-{a}.{DOMAIN}", f"{port_b}-{b}.{DOMAIN}"
    # The API answers the port's own host, not its path on the API's origin.
    assert made["url"] == f"http://{host_a}/?token={made['token']}"
    token = made["token"]
    async with stack.client(None) as browser:
        opened = await browser.get("/hello", params={"token": token}, headers={"Host": host_a})
        assert opened.status_code == 200 and opened.text == "hello from the sandbox"
        seen = json.loads(opened.headers["x-seen"])
        assert seen["path"] == "/hello" and seen["prefix"] is None and seen["port_token"] is None
        cookie = opened.headers["set-cookie"]
        assert cookie.startswith(f"capsa_port_token={token}; Path=/; Max-Age=") and "Domain" not in cookie
        # The cookie opens the rest of the port's host.
        again = await browser.get("/hello", headers={"Host": host_a, "Cookie": f"capsa_port_token={token}"})
        assert again.status_code == 200
        # A's token opens nothing of B's: not B's port on its host, not the same port number under B.
        for host in (host_b, f"{port_a}-{b}.{DOMAIN}"):
            assert_problem(await browser.get("/hello", params={"token": token}, headers={"Host": host}),
                           404, "not_found")
            assert_problem(await browser.get("/hello", headers={"Host": host,
                                                                "Cookie": f"capsa_port_token={token}"}),
                           404, "not_found")
        # B's own token does open B's host.
        own = await browser.get("/hello", params={"token": made_b["token"]}, headers={"Host": host_b})
        assert own.status_code == 200
        # On a port's host the app keeps its origin: its cookies (never for the whole domain), its policies;
        # what reaches beyond the host is dropped.
        hostile = await browser.get("/hostile", params={"token": token}, headers={"Host": host_a})
        cookies = cookies_of(hostile)
        assert cookies["root"] == "root=1; Path=/" and cookies["domain"] == "domain=1; Path=/"
        assert "cpt_attacker" not in str(hostile.headers.get_list("set-cookie"))
        for name in ("clear-site-data", "nel", "report-to", "alt-svc"):
            assert name not in hostile.headers, name
        assert hostile.headers["service-worker-allowed"] == "/"
        # The API is not served on a port's host: its paths are the app's.
        listing = await browser.get("/v1/sessions",
                                    headers={"Host": host_a, "Authorization": f"Bearer {key}"})
        assert listing.status_code == 404 and listing.text == "no such page"
        # Under the domain, a host naming no session's port: 404.
        assert_problem(await browser.get("/", headers={"Host": f"api.{DOMAIN}"}), 404, "not_found")
    # The API still answers on its own host.
    async with stack.client(key) as client:
        assert (await client.get(f"/v1/sessions/{a}")).status_code == 200
    # WebSockets route by host too, with the same token rules.
    ws = await ws_connect(stack.url, host_a, f"/ws?token={token}")
    await ws.send("over its own host")
    assert await ws.receive() == "over its own host"
    await ws.close()
    with pytest.raises(WebSocketRejected) as refused:
        await ws_connect(stack.url, host_b, f"/ws?token={token}")
    assert refused.value.status == 404


# --- Port tokens: expiry, listing, revocation -------------------------------------------------------------


async def test_port_tokens_expire_are_listed_and_revoked_whatever_their_port(make_stack: MakeStack) -> None:
    stack = await make_stack(settings={"port_token_max_ttl": 3600})
    key = await stack.tenant_key("acme")
    other = await stack.tenant_key("globex")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
        short = (await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens",
                                   json={"ttl_seconds": 120})).json()
        default = (await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")).json()
        cdp = (await client.post(f"/v1/sessions/{sid}/ports/{CDP_PORT}/tokens")).json()  # as GET …/browser
        for ttl in (3601, 10, 10**9):
            assert_problem(await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens",
                                             json={"ttl_seconds": ttl}), 422, "validation_error")
        listed = (await client.get(f"/v1/sessions/{sid}/port-tokens")).json()["items"]
    assert [t["id"] for t in listed] == [short["id"], default["id"], cdp["id"]]
    assert all("token" not in t for t in listed)
    lifetime = {t["id"]: (t["expires_at"], t["created_at"]) for t in listed}
    assert lifetime[short["id"]][0] == short["expires_at"]
    assert default["expires_at"] is not None
    hello = f"/v1/sessions/{sid}/ports/{port}/hello"
    async with stack.client(None) as anon:
        assert (await anon.get(hello, params={"token": short["token"]})).status_code == 200
    # Time passes for the short token (its expiry moved into the past): refused, and no longer listed.
    engine = create_async_engine(stack.database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(update(PortTokenRow).where(PortTokenRow.id == short["id"])
                               .values(expires_at=utcnow() - timedelta(seconds=1)))
    finally:
        await engine.dispose()
    async with stack.client(None) as anon:
        assert_problem(await anon.get(hello, params={"token": short["token"]}), 404, "not_found")
        assert_problem(await anon.get(hello, headers={"Cookie": f"capsa_port_token={short['token']}"}),
                       404, "not_found")
        assert (await anon.get(hello, params={"token": default["token"]})).status_code == 200
    async with stack.client(other) as intruder:  # another tenant sees and revokes nothing
        assert_problem(await intruder.get(f"/v1/sessions/{sid}/port-tokens"), 404, "not_found")
        assert_problem(await intruder.delete(f"/v1/sessions/{sid}/port-tokens/{cdp['id']}"), 404, "not_found")
    async with stack.client(key) as client:
        listed = (await client.get(f"/v1/sessions/{sid}/port-tokens")).json()["items"]
        assert [t["id"] for t in listed] == [default["id"], cdp["id"]]
        # Any token is revoked by its id alone, the CDP one GET …/browser would have made included.
        for made in (cdp, default):
            revoked = await client.delete(f"/v1/sessions/{sid}/port-tokens/{made['id']}")
            assert revoked.status_code == 204
        assert_problem(await client.delete(f"/v1/sessions/{sid}/port-tokens/{cdp['id']}"), 404, "not_found")
        assert (await client.get(f"/v1/sessions/{sid}/port-tokens")).json()["items"] == []
    async with stack.client(None) as anon:
        assert_problem(await anon.get(hello, params={"token": default["token"]}), 404, "not_found")


async def test_sdk_lists_and_revokes_port_tokens(make_stack: MakeStack) -> None:
    from capsa.sdk import AsyncSession

    stack = await make_stack(settings={"ports_domain": DOMAIN})
    key = await stack.tenant_key("acme")
    session = await AsyncSession.create(api_url=stack.url, api_key=key)
    try:
        url = await session.ports.url(8080, "/app/x", ttl_seconds=300)
        assert url.startswith(f"http://8080-{session.id}.{DOMAIN}/app/x?token=cpt_")
        made = await session.ports.create_token(8080)
        tokens = await session.ports.list_tokens()
        assert len(tokens) == 2 and tokens[1].id == made.id and tokens[1].expires_at == made.expires_at
        await session.ports.revoke_token(None, tokens[0].id)
        assert [t.id for t in await session.ports.list_tokens()] == [made.id]
    finally:
        await session.close()


# --- Port tokens out of the logs ------------------------------------------------------------------------


async def test_port_tokens_do_not_reach_the_server_logs(make_stack: MakeStack) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    port = free_port()
    async with stack.client(key) as client:
        sid = await new_session(client)
        await start_app(client, sid, port)
        token = (await client.post(f"/v1/sessions/{sid}/ports/{port}/tokens")).json()["token"]
    # The control plane as `capsa serve` and `capsa control` run it: a QuietServer, log level info, its
    # lines rendered by the process's logging (capsa.common.logs.configure, which every capsa process calls).
    with configured() as rendered:
        server = QuietServer(uvicorn.Config(build_app(stack.control_settings()), host="127.0.0.1", port=0,
                                            log_level="info", log_config=None))
        await _serve_with_tokens(server, sid, port, token)
        lines = rendered.getvalue().splitlines()
    assert any("WebSocket" in line and "/ws?" in line for line in lines), lines
    assert any("vnc.html" in line for line in lines), lines
    leaked = [line for line in lines if token in line or quote(token, safe="") in line]
    assert not leaked, leaked


async def _serve_with_tokens(server: QuietServer, sid: str, port: int, token: str) -> None:
    """Runs ``server`` for a port WebSocket with ``token``, a refused one, and a noVNC page URL."""
    task = asyncio.create_task(server.serve())
    try:
        await wait_started(server, task)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        prefix = f"/v1/sessions/{sid}/ports/{port}"
        ws = await ws_connect(url, urlsplit(url).netloc, f"{prefix}/ws?token={token}")
        await ws.send("x")
        assert await ws.receive() == "x"
        await ws.close()
        with pytest.raises(WebSocketRejected):  # a refused handshake is logged too
            await ws_connect(url, urlsplit(url).netloc, f"{prefix}/ws?token={token}x")
        # A noVNC live-view URL: the token is also URL-encoded inside its path= parameter.
        novnc = (f"{prefix}/vnc.html?autoconnect=true&path="
                 f"{quote(f'{prefix[1:]}/websockify?token={token}', safe='')}&token={token}")
        async with httpx.AsyncClient(base_url=url) as browser:
            await browser.get(novnc)
    finally:
        server.should_exit = True
        await task


# --- CDP: the download rewrite and its bypasses ----------------------------------------------------------


def _download(path: str = "/etc/cron.d", method: str = "Browser.setDownloadBehavior") -> dict[str, Any]:
    return {"id": 1, "method": method, "params": {"behavior": "allow", "downloadPath": path}}


def test_cdp_download_rewrite_reads_escapes_nested_targets_and_repeated_keys() -> None:
    # A \\u0042 escape in the method name: the same method to the browser's JSON parser.
    escaped = json.dumps(_download()).replace("Browser.setDownloadBehavior", "\\u0042rowser.set\\u0044ownload"
                                              "Behavior")
    assert "setDownloadBehavior" not in escaped
    assert json.loads(pin_downloads(escaped))["params"]["downloadPath"] == DOWNLOADS_DIR
    # ... and escapes in the path.
    path_escaped = json.dumps(_download()).replace("/etc", "\\u002fetc")
    assert json.loads(pin_downloads(path_escaped))["params"]["downloadPath"] == DOWNLOADS_DIR
    # A command wrapped (twice) in Target.sendMessageToTarget.
    inner = json.dumps(_download(method="Page.setDownloadBehavior"))
    middle = json.dumps({"id": 2, "method": "Target.sendMessageToTarget",
                         "params": {"sessionId": "S", "message": inner}})
    outer = json.dumps({"id": 3, "method": "Target.sendMessageToTarget",
                        "params": {"sessionId": "T", "message": middle}})
    middle_sent = json.loads(json.loads(pin_downloads(outer))["params"]["message"])
    unwrapped = json.loads(middle_sent["params"]["message"])
    assert unwrapped["params"] == {"behavior": "allow", "downloadPath": DOWNLOADS_DIR}
    # A repeated key: what the browser gets has one of each, the one this check read.
    repeated = ('{"id": 4, "method": "Browser.getVersion", "params": {"behavior": "allow", "downloadPath": '
                '"/etc"}, "method": "Browser.setDownloadBehavior"}')
    sent = json.loads(pin_downloads(repeated))
    assert sent["method"] == "Browser.setDownloadBehavior" and sent["params"]["downloadPath"] == DOWNLOADS_DIR
    first_wins = ('{"id": 5, "method": "Browser.setDownloadBehavior", "params": {"behavior": "allow", '
                  '"downloadPath": "/etc"}, "method": "Browser.getVersion"}')
    assert pin_downloads(first_wins).count('"method"') == 1
    # Not JSON to this parser (a trailing comma): not sent on as it is.
    lenient = '{"id": 6, "method": "Browser.setDownloadBehavior", "params": {"behavior": "allow", ' \
              '"downloadPath": "/etc",},}'
    assert "/etc" not in pin_downloads(lenient)


async def test_raw_tunnel_to_the_cdp_port_takes_the_api_key(make_stack: MakeStack) -> None:
    stack = await make_stack()
    key = await stack.tenant_key("acme")
    async with stack.client(key) as client:
        sid = await new_session(client)
        token = (await client.post(f"/v1/sessions/{sid}/ports/{CDP_PORT}/tokens")).json()["token"]
    url = urlsplit(stack.url)
    target = f"/v1/sessions/{sid}/tunnels/{CDP_PORT}"
    for headers in ([("X-Capsa-Port-Token", token)], []):
        query = f"?token={token}" if not headers else ""
        stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
        with pytest.raises(Exception) as refused:
            await open_tunnel(stream, url.netloc, target + query, headers=headers)
        assert getattr(refused.value, "code", None) == "raw_tunnel_refused"
        assert getattr(refused.value, "status", None) == 403
    # The API key (which can run commands as root in the guest anyway) still opens it: nothing listens
    # on the CDP port of this sandbox, so the node says so.
    stream = await SocketStream.connect(url.hostname or "127.0.0.1", url.port or 80)
    with pytest.raises(Exception) as unreachable:
        await open_tunnel(stream, url.netloc, target, headers=[("Authorization", f"Bearer {key}")])
    assert getattr(unreachable.value, "code", None) == "port_unreachable"

"""Connection providers are not a way into the control plane's network (issue 27, M2).

Endpoints on metadata, loopback or RFC 1918 addresses — given, or named by a discovery document served by a
real loopback provider that the test's operator allow-list lets the control plane reach — are refused with
``destination_refused`` and nothing is stored; ``http://`` is refused outside the allow-list; a name that
re-resolves to loopback after the provider was registered is never connected to; and what a provider (or an
internal service posing as one) answers reaches the tenant only as a standard OAuth error code, the detail
going to the server's log.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import h11
import httpx
import pytest

from tests.support.api_stack import ApiStack
from tests.support.h11_server import Answer, h11_handler
from tests.support.problems import assert_problem
from tests.support.resolvers import StaticResolver

pytestmark = pytest.mark.timeout(120)

KEY = base64.b64encode(os.urandom(32)).decode()
SECRET_TEXT = "INTERNAL-docker-daemon-answer-7f3a"
NAMES = {
    "metadata.idp.test": ["169.254.169.254"],
    "lan.idp.test": ["10.0.0.1"],
    "mixed.idp.test": ["93.184.216.34", "10.9.9.9"],
    "public.idp.test": ["93.184.216.34"],
}
JSON = [(b"content-type", b"application/json")]


@dataclass
class Provider:
    """A real loopback HTTP server playing an identity provider (or an internal service behind one)."""

    base: str
    documents: dict[str, object]
    connections: int = 0


def _answer(provider: Provider) -> Callable[[h11.Request, bytes], Answer]:
    def answer(request: h11.Request, _body: bytes) -> Answer:
        path = request.target.decode().split("?")[0]
        if path in provider.documents:
            return 200, JSON, json.dumps(provider.documents[path]).encode()
        # Every other path: an internal service's error, with text the tenant must never see.
        return 400, JSON, json.dumps({"error": f"{SECRET_TEXT} Server: Docker/24.0",
                                      "error_description": SECRET_TEXT}).encode()
    return answer


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    p = Provider("", {})
    handle = h11_handler(_answer(p))

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        p.connections += 1
        await handle(reader, writer)

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    p.base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield p
    server.close()


async def _stack(make_stack: Callable[..., Awaitable[ApiStack]], **settings: object
                 ) -> tuple[ApiStack, StaticResolver]:
    stack = await make_stack(settings={"secret_key": KEY, **settings})
    resolver = StaticResolver(NAMES)
    for replica in stack.replicas:
        replica.app.state.plane.resolver = resolver
    return stack, resolver


async def _register(api: httpx.AsyncClient, name: str, **endpoints: str) -> httpx.Response:
    return await api.post("/v1/connection-providers", json={"name": name, "client_id": "c", **endpoints})


async def test_given_endpoints_on_internal_addresses_are_refused(
        make_stack: Callable[..., Awaitable[ApiStack]], provider: Provider) -> None:
    stack, _ = await _stack(make_stack)  # no allow-list: only public https endpoints
    async with stack.client(await stack.tenant_key("acme")) as api:
        refused = ["https://169.254.169.254/latest/meta-data/iam", "https://10.0.0.1:2375/containers/json",
                   "https://127.0.0.1:8443/token", "https://[::ffff:10.0.0.1]/token", "https://0x7f.1/token",
                   "https://metadata.idp.test/token", "https://lan.idp.test/token",
                   "https://mixed.idp.test/token",
                   provider.base + "/token",  # loopback http, any port: refused without the allow-list
                   "http://public.idp.test/token"]  # http to a public address: refused
        for i, url in enumerate(refused):
            body = assert_problem(await _register(api, f"p{i}", token_endpoint=url), 422,
                                  "destination_refused")
            assert "token_endpoint" in body["detail"], body
        assert_problem(await _register(api, "iss", issuer=provider.base), 422, "destination_refused")
        assert_problem(await _register(api, "dev", token_endpoint="https://public.idp.test/token",
                                       device_authorization_endpoint="https://lan.idp.test/device"),
                       422, "destination_refused")
        assert (await api.get("/v1/connection-providers")).json()["items"] == []
        ok = await _register(api, "pub", token_endpoint="https://public.idp.test/token")
        assert ok.status_code == 201, ok.text
    assert provider.connections == 0


async def test_a_discovery_document_naming_internal_endpoints_is_refused(
        make_stack: Callable[..., Awaitable[ApiStack]], provider: Provider) -> None:
    stack, _ = await _stack(make_stack, oauth_allow_networks=["127.0.0.0/8"])  # the provider is reachable
    doc = "/.well-known/openid-configuration"
    async with stack.client(await stack.tenant_key("acme")) as api:
        internal = {"token_endpoint": ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1:2375/x",
                                       "https://lan.idp.test/token", "https://metadata.idp.test/t"],
                    "revocation_endpoint": ["http://10.0.0.1:2375/containers/create"],
                    "device_authorization_endpoint": ["https://mixed.idp.test/device"],
                    "authorization_endpoint": ["http://192.168.1.1/authorize"]}
        for field, urls in internal.items():
            for url in urls:
                token = provider.base + "/token"
                provider.documents[doc] = {"issuer": provider.base, "token_endpoint": token, field: url}
                body = assert_problem(await _register(api, "lab", issuer=provider.base), 422,
                                      "destination_refused")
                assert field in body["detail"], body
        assert (await api.get("/v1/connection-providers")).json()["items"] == []
        # The same document with its own (allowed) endpoints is fine.
        provider.documents[doc] = {"issuer": provider.base, "token_endpoint": provider.base + "/token"}
        ok = await _register(api, "lab", issuer=provider.base)
        assert ok.status_code == 201, ok.text


async def test_a_name_rebound_to_loopback_after_registration_is_not_connected(
        make_stack: Callable[..., Awaitable[ApiStack]], provider: Provider) -> None:
    stack, resolver = await _stack(make_stack)
    port = provider.base.rsplit(":", 1)[1]
    async with stack.client(await stack.tenant_key("acme")) as api:
        created = await _register(api, "idp", token_endpoint=f"https://public.idp.test:{port}/token",
                                  device_authorization_endpoint=f"https://public.idp.test:{port}/device")
        assert created.status_code == 201, created.text
        assert (await api.post("/v1/connections", json={"name": "c", "provider": "idp"})).status_code == 201
        resolver.records["public.idp.test"] = ["127.0.0.1"]  # DNS now points the name at the control plane
        login = await api.post("/v1/connections/c/login", json={"mode": "device"})
        assert_problem(login, 502, "provider_error")
    assert provider.connections == 0


async def test_provider_error_details_never_reach_the_tenant(
        make_stack: Callable[..., Awaitable[ApiStack]], provider: Provider,
        caplog: pytest.LogCaptureFixture) -> None:
    stack, _ = await _stack(make_stack, oauth_allow_networks=["127.0.0.0/8"])
    provider.documents["/device-ok"] = {"device_code": "dc", "user_code": "UC", "verification_uri":
                                        provider.base + "/verify", "expires_in": 600, "interval": 1}
    async with stack.client(await stack.tenant_key("acme")) as api:
        for name, device in (("bad", "/device"), ("good", "/device-ok")):
            created = await _register(api, name, token_endpoint=provider.base + "/token",
                                      device_authorization_endpoint=provider.base + device)
            assert created.status_code == 201, created.text
            added = await api.post("/v1/connections", json={"name": name, "provider": name})
            assert added.status_code == 201, added.text
        with caplog.at_level(logging.WARNING, logger="capsa.control.connections.oauth_client"):
            # The device authorization endpoint answers with the internal text.
            start = await api.post("/v1/connections/bad/login", json={"mode": "device"})
            body = assert_problem(start, 502, "provider_error")
            assert SECRET_TEXT not in start.text and "Docker" not in start.text
            assert "invalid_response" in body["detail"], body
            # The token endpoint answers a poll with it.
            started = await api.post("/v1/connections/good/login", json={"mode": "device"})
            assert started.status_code == 200, started.text
            poll = await api.post(f"/v1/connections/good/logins/{started.json()['login_id']}/poll")
            assert_problem(poll, 502, "provider_error")
            assert SECRET_TEXT not in poll.text and "Docker" not in poll.text
        assert SECRET_TEXT in caplog.text  # the operator can still see what the provider said

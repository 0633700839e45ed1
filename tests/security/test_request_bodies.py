"""Issue 27, H1 and the low finding "no general request rate limit", against the real control plane
and node API apps (fake runtime, no VM):

- H1: unauthenticated multi-hundred-MiB bodies, declared and chunked, to every kind of route of both apps
  are answered (401/413 problem+json) without being read: the body is a generator that counts what the
  server pulled. Oversized bodies from a valid caller are refused at the limit; the number of requests in
  flight and the bytes of bodies held are bounded.
- A per-client request rate limit (``CAPSA_REQUEST_RATE_LIMIT``), on both apps.

The requests go through httpx's ASGI transport into the very app objects that uvicorn serves for the
stack, so the body is pulled only when the app asks for it and the count is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from capsa.frontends import MCP_BODY_BYTES
from capsa.node.api.app import create_node_app
from tests.support.api_stack import ApiStack
from tests.support.counted_body import CHUNK, CountedBody, send_counted
from tests.support.problems import assert_problem

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
ATTACK = 300 * MIB
LIMIT = 1 * MIB  # RequestLimits.max_body_bytes by default
SLACK = 2 * CHUNK  # what the app may pull past a limit before it is seen passing it
MakeStack = Callable[..., Awaitable[ApiStack]]


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _control(stack: ApiStack) -> FastAPI:
    return stack.replicas[0].app


# Every kind of control-plane route that takes a body, with the credential its route takes left out.
STREAMED = ("/files/content", "/StreamInput", "/envd/files")
"""Routes whose own limit (max_file_bytes) is above the attack's size: refused for the credential."""
CONTROL_ROUTES = [
    ("POST", "/v1/sessions", "unauthorized"),
    ("POST", "/v1/secrets", "unauthorized"),
    ("POST", "/v1/connection-providers", "unauthorized"),
    ("PUT", "/v1/sessions/ses_00000000000000000000/policy", "unauthorized"),
    ("POST", "/v1/sessions/ses_00000000000000000000/commands", "unauthorized"),
    ("PUT", "/v1/sessions/ses_00000000000000000000/files/content?path=/tmp/x", "unauthorized"),
    ("POST", "/v1/keys", "unauthorized"),
    ("POST", "/v1/nodes/enrol", "enrol_token_invalid"),
    ("POST", "/v1/nodes/node-test/heartbeat", "unauthorized"),
    ("POST", "/mcp", "unauthorized"),
    ("POST", "/e2b/sandboxes", "unauthorized"),
    ("POST", "/e2b/envd/process.Process/List", "unauthorized"),
    ("POST", "/e2b/envd/process.Process/StreamInput", "unauthorized"),
    ("POST", "/e2b/envd/files?path=/tmp/x", "unauthorized"),
]


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "chunked"])
async def test_unauthenticated_bodies_are_refused_unread_on_the_control_plane(
        make_stack: MakeStack, declared: bool) -> None:
    stack = await make_stack()
    app = _control(stack)
    before = _rss()
    wrong = {"authorization": "Bearer csk_wrongwrongwr_" + "w" * 32, "x-api-key": "csk_nope",
             "x-access-token": "csk_nope", "e2b-sandbox-id": "ses_00000000000000000000"}
    for method, path, code in CONTROL_ROUTES:
        for headers in ({}, wrong):
            body = CountedBody(ATTACK, first=b'{"template": "base", "metadata": {"a": "')
            response = await send_counted(app, method, path, body, declared=declared, headers=headers)
            assert body.pulled == 0, (method, path, headers, body.pulled)
            streamed = path.split("?")[0].endswith(STREAMED)
            if declared and not streamed:  # a length past the route's limit is refused before the credential
                assert_problem(response, 413, "payload_too_large")
            else:
                assert_problem(response, 401, code)
    grown = _rss() - before
    print(f"control plane, {len(CONTROL_ROUTES) * 2} attacks of {ATTACK // MIB} MiB: "
          f"RSS grew {grown // MIB} MiB")
    assert grown < 64 * MIB


async def test_unauthenticated_bodies_are_refused_unread_on_the_node_api(make_stack: MakeStack) -> None:
    stack = await make_stack()
    assert stack.agent is not None
    app = create_node_app(stack.agent, stack.node_token)
    routes = [("POST", "/node/v1/sandboxes"), ("PUT", "/node/v1/sandboxes/sbx_x/policy"),
              ("POST", "/node/v1/sandboxes/sbx_x/exec"),
              ("POST", "/node/v1/sandboxes/sbx_x/processes/1/stdin"),
              ("PUT", "/node/v1/sandboxes/sbx_x/files/content?path=/tmp/x"),
              ("PUT", "/node/v1/sandboxes/sbx_x/files/archive?path=/tmp"),
              ("POST", "/node/v1/approvals/apr_x/decision")]
    for method, path in routes:
        for declared in (True, False):
            for headers in ({}, {"authorization": "Bearer not-the-node-token"}):
                body = CountedBody(ATTACK)
                response = await send_counted(app, method, path, body, declared=declared, headers=headers)
                assert body.pulled == 0, (method, path, declared, body.pulled)
                assert response.status_code in (401, 413), response.text
                assert_problem(response, response.status_code,
                         "unauthorized" if response.status_code == 401 else "payload_too_large")


async def test_oversized_bodies_from_valid_callers_are_cut_at_the_limit(make_stack: MakeStack) -> None:
    stack = await make_stack()
    app = _control(stack)
    key = {"authorization": f"Bearer {await stack.tenant_key('acme')}"}
    declared = CountedBody(ATTACK)
    assert_problem(await send_counted(app, "POST", "/v1/sessions", declared, declared=True, headers=key),
             413, "payload_too_large")
    assert declared.pulled == 0
    for path, limit in (("/v1/sessions", LIMIT), ("/v1/secrets", LIMIT), ("/mcp", MCP_BODY_BYTES)):
        chunked = CountedBody(ATTACK, first=b'{"template": "')
        assert_problem(await send_counted(app, "POST", path, chunked, declared=False, headers=key),
                 413, "payload_too_large")
        assert chunked.pulled <= limit + SLACK, (path, chunked.pulled)
    envd = CountedBody(ATTACK)
    response = await send_counted(app, "POST", "/e2b/envd/process.Process/List", envd, declared=False,
                           headers={"x-access-token": key["authorization"][7:],
                                    "content-type": "application/json"})
    assert_problem(response, 413, "payload_too_large")
    assert envd.pulled <= 4 * MIB + SLACK
    # The node API: with its token, a chunked JSON body is cut at the limit too.
    assert stack.agent is not None
    node = create_node_app(stack.agent, stack.node_token)
    body = CountedBody(ATTACK)
    assert_problem(await send_counted(node, "POST", "/node/v1/sandboxes", body, declared=False,
                         headers={"authorization": f"Bearer {stack.node_token}"}), 413, "payload_too_large")
    assert body.pulled <= LIMIT + SLACK


async def test_requests_and_bodies_in_flight_are_bounded(make_stack: MakeStack) -> None:
    from capsa.common.request_limits import RequestLimits

    stack = await make_stack()
    assert stack.agent is not None
    limits = RequestLimits(max_in_flight=3, body_memory_bytes=2 * MIB + 10, rate_limit="off")
    node = create_node_app(stack.agent, stack.node_token, limits)
    token = {"authorization": f"Bearer {stack.node_token}"}
    release = asyncio.Event()

    def hold(declared: bool) -> asyncio.Task[httpx.Response]:
        body = CountedBody(size=10, gate=release)
        return asyncio.create_task(send_counted(node, "POST", "/node/v1/sandboxes", body, declared=declared,
                                         headers=token))

    # Two chunked JSON bodies reserve 1 MiB (the route's limit) each while they are read.
    tasks = [hold(declared=False), hold(declared=False)]
    await asyncio.sleep(0.2)
    refused = CountedBody(size=20)
    response = await send_counted(node, "POST", "/node/v1/sandboxes", refused, declared=True, headers=token)
    assert_problem(response, 503, "overloaded")
    assert refused.pulled == 0
    tasks.append(hold(declared=True))  # 10 declared bytes still fit, and make three requests in flight
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=node), base_url="http://n") as client:
        response = await client.get("/node/v1/health")
        assert_problem(response, 503, "overloaded")
        assert response.headers["retry-after"] == "1"
        release.set()
        for response in await asyncio.gather(*tasks):
            assert_problem(response, 422, "validation_error")  # each went on to its route
        assert (await client.get("/node/v1/health")).status_code == 200


async def test_a_client_is_rate_limited(make_stack: MakeStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSA_REQUEST_RATE_LIMIT", "5/minute")
    stack = await make_stack()
    app = _control(stack)
    one = httpx.ASGITransport(app=app, client=("198.51.100.1", 4000))  # not the stack's own 127.0.0.1
    async with httpx.AsyncClient(transport=one, base_url="http://capsa") as client:
        assert [(await client.get("/v1/health")).status_code for _ in range(5)] == [200] * 5
        response = await client.get("/v1/health")
        assert_problem(response, 429, "rate_limited")
        assert 1 <= int(response.headers["retry-after"]) <= 60
    other = httpx.ASGITransport(app=app, client=("192.0.2.7", 4000))
    async with httpx.AsyncClient(transport=other, base_url="http://capsa") as client:
        assert (await client.get("/v1/health")).status_code == 200  # another address has its own budget
    # The node API counts only the requests without its token.
    assert stack.agent is not None
    node = create_node_app(stack.agent, stack.node_token)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=node), base_url="http://n",
                                 headers={"authorization": f"Bearer {stack.node_token}"}) as client:
        assert {(await client.get("/node/v1/info")).status_code for _ in range(8)} == {200}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=node), base_url="http://n") as client:
        statuses = [(await client.get("/node/v1/health")).status_code for _ in range(6)]
        assert statuses == [200] * 5 + [429]

"""Connection tokens in the broker, in-process on loopback: the broker adds the current access token to
requests to bound destinations (overriding what the sandbox sent), fetches it once however many requests
wait (single flight), fetches again before expiry, stops at once on revocation, never sends it over plain
HTTP, and redacts it from responses. The token issuer here is the seam a node's link to the control
plane plugs into (``ConnectionTokens.fetch``); the control plane's side is
tests/unit/test_control_connections.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import pytest

from capsa.common.connection_wire import ConnectionTokenOut
from capsa.common.egress_policy import EgressPolicy
from capsa.common.errors import CapsaError
from capsa.node.egress.audit import ListSink
from capsa.node.egress.broker import EgressBroker
from capsa.node.egress.ca import SandboxCA
from capsa.node.egress.secrets import InMemorySecretStore, SecretBox
from capsa.node.egress.tokens import ConnectionTokens
from capsa.node.net.sandbox_net import ServicePorts
from tests.support.h11_server import Answer, h11_handler
from tests.support.resolvers import StaticResolver

PORTS = ServicePorts(http=0, tls=0, proxy=0, dns=0)
CONN = "con_" + "a" * 20


class Issuer:
    """Plays the control plane: hands out a new token per fetch, slowly, and counts fetches."""

    def __init__(self, lifetime: float = 3600.0, delay: float = 0.2) -> None:
        self.lifetime, self.delay = lifetime, delay
        self.issued: list[str] = []
        self.revoked = False

    async def __call__(self, session_id: str, connection_id: str) -> ConnectionTokenOut:
        assert connection_id == CONN and session_id == "ses_a"
        await asyncio.sleep(self.delay)
        if self.revoked:
            raise CapsaError("revoked", code="connection_revoked", status=403)
        token = "at-" + secrets.token_hex(16)
        self.issued.append(token)
        return ConnectionTokenOut(access_token=token, expires_in=self.lifetime, lifetime=self.lifetime)


def _saw_authorization(request: h11.Request, _body: bytes) -> Answer:
    """The protected API: answers with the Authorization header it received (so redaction shows)."""
    return 200, [], b"saw " + dict(request.headers).get(b"authorization", b"nothing")


_api = h11_handler(_saw_authorization)


class Lab:
    def __init__(self, tmp: Path, issuer: Issuer) -> None:
        self.tmp, self.issuer, self.sink = tmp, issuer, ListSink()
        self.ca = SandboxCA("api", ["api.test"])

    async def start(self) -> EgressBroker:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

        def pick(obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _c: ssl.SSLContext) -> None:
            obj.context = self.ca.server_context(name or "api.test")

        ctx.sni_callback = pick
        self.https = await asyncio.start_server(_api, "127.0.0.1", 0, ssl=ctx)
        self.http = await asyncio.start_server(_api, "127.0.0.1", 0)
        (self.tmp / "ca.pem").write_bytes(self.ca.cert_pem)
        self.broker = EgressBroker(
            secrets=InMemorySecretStore(SecretBox(os.urandom(32))), sink=self.sink,
            resolver=StaticResolver({"api.test": ["127.0.0.1"]}),
            upstream_ssl=ssl.create_default_context(cafile=str(self.tmp / "ca.pem")),
            allow_networks=["127.0.0.0/8"], upstream_http_port=self.http.sockets[0].getsockname()[1],
            upstream_https_port=self.https.sockets[0].getsockname()[1], tokens=ConnectionTokens(self.issuer))
        sbx = self.broker.register("sbx_a", "127.0.0.1", POLICY, session_id="ses_a")
        await self.broker.listen("sbx_a", "127.0.0.1", ports=PORTS)
        self.sandbox_ca = sbx.ca.cert_pem
        return self.broker

    async def get(self, headers: str = "") -> tuple[int, bytes]:
        """One HTTPS request from the "sandbox" to api.test through the broker's TLS listener."""
        port = self.broker.get("sbx_a").bound["tls"][1]
        ctx = ssl.create_default_context(cadata=self.sandbox_ca.decode())
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="api.test")
        writer.write(f"GET /me HTTP/1.1\r\nHost: api.test\r\n{headers}Connection: close\r\n\r\n".encode())
        data = await reader.read()
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), body

    async def close(self) -> None:
        await self.broker.close()
        self.https.close()
        self.http.close()


POLICY = EgressPolicy.from_data({
    "domains": [{"domain": "api.test"}],
    "connections": [{"connection": CONN, "domains": ["api.test"], "header": "Authorization",
                     "format": "Bearer {token}"}],
})


@pytest.fixture
def issuer() -> Issuer:
    return Issuer()


@pytest.fixture
async def lab(tmp_path: Path, issuer: Issuer) -> AsyncIterator[Lab]:
    lab = Lab(tmp_path, issuer)
    await lab.start()
    yield lab
    await lab.close()


def _events_text(sink: ListSink) -> str:
    return "\n".join(e.model_dump_json() for e in sink.events)


async def test_token_is_injected_over_the_sandbox_header_and_redacted_from_the_answer(lab: Lab) -> None:
    status, body = await lab.get("Authorization: Bearer sandbox-made-this-up\r\n")
    assert status == 200
    [token] = lab.issuer.issued
    # The upstream saw the real token, not the sandbox's header; the sandbox reads it back redacted.
    assert body.startswith(b"saw Bearer ") and token.encode() not in body and b"sandbox-made" not in body
    injected = [e for e in lab.sink.events if e.kind == "connection" and e.detail == {
        "connection_id": CONN, "action": "inject"}]
    assert len(injected) == 1 and injected[0].decision == "allow" and injected[0].destination == "api.test"
    assert token not in _events_text(lab.sink)


async def test_twenty_concurrent_requests_with_no_token_cause_one_fetch(lab: Lab) -> None:
    results = await asyncio.gather(*(lab.get() for _ in range(20)))
    assert [s for s, _ in results] == [200] * 20
    assert len(lab.issuer.issued) == 1
    fetched = [e for e in lab.sink.events
               if e.kind == "connection" and (e.detail or {}).get("action") == "refresh"]
    assert len(fetched) == 1


@pytest.mark.parametrize("issuer", [Issuer(lifetime=1.2, delay=0.1)])
async def test_token_is_fetched_again_before_it_expires_once_for_twenty_requests(lab: Lab) -> None:
    assert (await lab.get())[0] == 200
    assert len(lab.issuer.issued) == 1
    await asyncio.sleep(1.0)  # within the refresh margin (a quarter of 1.2 s) of expiry: due
    results = await asyncio.gather(*(lab.get() for _ in range(20)))
    assert [s for s, _ in results] == [200] * 20
    assert len(lab.issuer.issued) == 2
    assert lab.broker.tokens.peek(CONN) == lab.issuer.issued[1]


async def test_revocation_stops_the_next_request_and_is_audited(lab: Lab) -> None:
    assert (await lab.get())[0] == 200
    lab.broker.tokens.revoke(CONN)
    status, body = await lab.get()
    assert status == 403 and b"revoked" in body
    assert lab.broker.tokens.peek(CONN) is None and len(lab.issuer.issued) == 1
    denied = [e for e in lab.sink.events if e.kind == "connection" and e.decision == "deny"]
    assert denied and denied[-1].detail == {"connection_id": CONN, "action": "revoked"}


async def test_a_revocation_answer_from_the_control_plane_also_stops_injection(lab: Lab) -> None:
    lab.issuer.revoked = True
    status, _ = await lab.get()
    assert status == 403 and lab.broker.tokens.revoked(CONN)


async def test_no_token_over_plain_http(lab: Lab) -> None:
    port = lab.broker.get("sbx_a").bound["http"][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /me HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    assert data.startswith(b"HTTP/1.1 403") and lab.issuer.issued == []


def test_policy_refuses_bindings_to_hosts_it_does_not_allow_or_twice() -> None:
    from capsa.common.egress_policy import PolicyError

    with pytest.raises(PolicyError, match="does not allow"):
        EgressPolicy.from_data({"domains": [{"domain": "api.test"}],
                                "connections": [{"connection": CONN, "domains": ["other.test"]}]})
    with pytest.raises(PolicyError, match="bound twice"):
        EgressPolicy.from_data({"domains": [{"domain": "api.test"}], "connections": [
            {"connection": CONN, "domains": ["api.test"]}, {"connection": "con_" + "b" * 20,
                                                            "domains": ["api.test"]}]})
    with pytest.raises(PolicyError, match="token"):
        EgressPolicy.from_data({"domains": [{"domain": "api.test"}], "connections": [
            {"connection": CONN, "domains": ["api.test"], "format": "Bearer"}]})

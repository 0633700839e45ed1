"""A local OAuth 2.0 authorization server and protected API for connection tests, built on authlib's
server side (authorization code + PKCE S256, refresh tokens with rotation, the device authorization grant,
RFC 7009 revocation, RFC 8414 metadata) and served by uvicorn on a socket the test opens (loopback, or in
a test-made network namespace).

The person signing in is always ``alice`` and consents at once (``GET /authorize`` answers the redirect to
the client's callback); a device sign-in is approved with ``POST /device/approve``. ``GET /api/whoami``
is the protected API: it answers 200 for a live access token, 401 otherwise, and never echoes the token.
Counters (``issued``, ``refreshes``, ``revocations``, ``api_calls``) are what tests assert on.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import uvicorn
from authlib.oauth2.rfc6749 import AuthorizationServer, ClientMixin, OAuth2Request
from authlib.oauth2.rfc6749.grants import AuthorizationCodeGrant, RefreshTokenGrant
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7009 import RevocationEndpoint
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oauth2.rfc8628 import DeviceAuthorizationEndpoint, DeviceCodeGrant, DeviceCredentialDict
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from capsa.node.egress.dns import DnsServerProtocol
from capsa.node.net.nsexec import open_listener
from tests.support.resolvers import static_dns_handler

__all__ = ["CLIENT_ID", "CLIENT_SECRET", "OAuthLab", "OAuthWorld", "oauth_world", "start_oauth_server"]

CLIENT_ID = "capsa-test-client"
CLIENT_SECRET = "cs-" + secrets.token_hex(16)
USER = "alice"


@dataclass
class _Client(ClientMixin):  # type: ignore[misc]
    client_id: str
    client_secret: str

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str | None:
        return None

    def get_allowed_scope(self, scope: str | None) -> str:
        return scope or ""

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return redirect_uri.endswith("/v1/connections/callback")

    def check_client_secret(self, client_secret: str) -> bool:
        return secrets.compare_digest(client_secret, self.client_secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type: str) -> bool:
        return response_type == "code"

    def check_grant_type(self, grant_type: str) -> bool:
        return True


@dataclass
class _Code:
    code: str
    client_id: str
    redirect_uri: str
    scope: str
    code_challenge: str | None
    code_challenge_method: str | None

    def get_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_scope(self) -> str:
        return self.scope


@dataclass
class _Token:
    access_token: str
    refresh_token: str | None
    client_id: str
    scope: str
    expires_at: float
    revoked: bool = False

    def check_client(self, client: _Client) -> bool:
        return client.client_id == self.client_id

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return int(self.expires_at - time.time())

    def is_expired(self) -> bool:
        return time.time() >= self.expires_at

    def is_revoked(self) -> bool:
        return self.revoked

    def get_user(self) -> str:
        return USER

    def get_client(self) -> None:
        return None


@dataclass
class OAuthLab:
    """State and counters of the authorization server."""

    expires_in: int = 3600
    refresh_delay: float = 0.0
    """Seconds the token endpoint takes to answer a refresh (lets concurrent callers pile up)."""
    issued: int = 0
    refreshes: int = 0
    revocations: int = 0
    api_calls: int = 0
    api_denied: int = 0
    codes: dict[str, _Code] = field(default_factory=dict)
    tokens: dict[str, _Token] = field(default_factory=dict)
    """access token -> record; refresh tokens are found by scanning (a handful in a test)."""
    devices: dict[str, DeviceCredentialDict] = field(default_factory=dict)
    approved: dict[str, bool] = field(default_factory=dict)
    base_url: str = ""
    server: uvicorn.Server | None = None
    task: asyncio.Task[None] | None = None

    def all_secrets(self) -> list[str]:
        """Every credential this server handed out (and the client secret): none may reach a guest."""
        out = [CLIENT_SECRET]
        for t in self.tokens.values():
            out.append(t.access_token)
            if t.refresh_token:
                out.append(t.refresh_token)
        return out

    def live_access_tokens(self) -> list[str]:
        return [a for a, t in self.tokens.items() if not t.revoked and not t.is_expired()]

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task


class _Request(OAuth2Request):  # type: ignore[misc]
    def __init__(self, method: str, uri: str, headers: Mapping[str, str], form: dict[str, str]) -> None:
        super().__init__(method=method, uri=uri, headers=headers)
        self._args = dict(parse_qsl(urlsplit(uri).query))
        self._form = form
        self.payload = BasicOAuth2Payload({**self._args, **form})

    @property
    def args(self) -> dict[str, str]:
        return self._args

    @property
    def form(self) -> dict[str, str]:
        return self._form


def _server(lab: OAuthLab) -> AuthorizationServer:
    client = _Client(CLIENT_ID, CLIENT_SECRET)

    class Server(AuthorizationServer):  # type: ignore[misc]
        def query_client(self, client_id: str) -> _Client | None:
            return client if client_id == CLIENT_ID else None

        def save_token(self, token: dict[str, Any], request: OAuth2Request) -> None:
            lab.issued += 1
            lab.tokens[token["access_token"]] = _Token(
                token["access_token"], token.get("refresh_token"), CLIENT_ID, token.get("scope", ""),
                time.time() + int(token["expires_in"]))

        def create_oauth2_request(self, request: _Request) -> _Request:
            return request

        def create_json_request(self, request: _Request) -> _Request:
            return request

        def handle_response(self, status: int, body: Any, headers: list[tuple[str, str]]) -> Response:
            hdrs = dict(headers)
            if isinstance(body, dict):
                return JSONResponse(body, status_code=status, headers=hdrs)
            return Response(body or b"", status_code=status, headers=hdrs)

        def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
            return None

    server = Server(scopes_supported=None)
    server.register_token_generator("default", BearerTokenGenerator(
        access_token_generator=lambda *a, **k: "at-" + secrets.token_hex(20),
        refresh_token_generator=lambda *a, **k: "rt-" + secrets.token_hex(20),
        expires_generator=lambda client, grant_type: lab.expires_in))

    class Code(AuthorizationCodeGrant):  # type: ignore[misc]
        TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

        def save_authorization_code(self, code: str, request: _Request) -> None:
            data = request.payload.data
            lab.codes[code] = _Code(code, CLIENT_ID, data.get("redirect_uri", ""), data.get("scope", ""),
                                    data.get("code_challenge"), data.get("code_challenge_method"))

        def query_authorization_code(self, code: str, client: _Client) -> _Code | None:
            return lab.codes.get(code)

        def delete_authorization_code(self, authorization_code: _Code) -> None:
            lab.codes.pop(authorization_code.code, None)

        def authenticate_user(self, authorization_code: _Code) -> str:
            return USER

    class Refresh(RefreshTokenGrant):  # type: ignore[misc]
        TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]
        INCLUDE_NEW_REFRESH_TOKEN = True  # rotation: every refresh answers a new refresh token

        def authenticate_refresh_token(self, refresh_token: str) -> _Token | None:
            for t in lab.tokens.values():
                if t.refresh_token == refresh_token and not t.revoked:
                    return t
            return None

        def authenticate_user(self, credential: _Token) -> str:
            return USER

        def revoke_old_credential(self, refresh_token: _Token) -> None:
            refresh_token.revoked = True
            lab.refreshes += 1

    class Device(DeviceCodeGrant):  # type: ignore[misc]
        def query_device_credential(self, device_code: str) -> DeviceCredentialDict | None:
            return lab.devices.get(device_code)

        def query_user_grant(self, user_code: str) -> tuple[str, bool] | None:
            if user_code not in lab.approved:
                return None
            return USER, lab.approved[user_code]

        def should_slow_down(self, credential: DeviceCredentialDict) -> bool:
            return False

    class DeviceEndpoint(DeviceAuthorizationEndpoint):  # type: ignore[misc]
        INTERVAL = 1

        def get_verification_uri(self) -> str:
            return lab.base_url + "/device"

        def save_device_credential(self, client_id: str, scope: str, data: dict[str, Any]) -> None:
            lab.devices[data["device_code"]] = DeviceCredentialDict(
                client_id=client_id, scope=scope, expires_at=time.time() + data["expires_in"], **data)

    class Revoke(RevocationEndpoint):  # type: ignore[misc]
        CLIENT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

        def query_token(self, token_string: str, token_type_hint: str | None) -> _Token | None:
            for t in lab.tokens.values():
                if token_string in (t.access_token, t.refresh_token):
                    return t
            return None

        def revoke_token(self, token: _Token, request: _Request) -> None:
            token.revoked = True
            lab.revocations += 1

    server.register_grant(Code, [CodeChallenge(required=True)])
    server.register_grant(Refresh)
    server.register_grant(Device)
    server.register_endpoint(DeviceEndpoint)
    server.register_endpoint(Revoke)
    return server


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def _app(lab: OAuthLab) -> Starlette:
    server = _server(lab)

    async def wrap(request: Request) -> _Request:
        form = {k: str(v) for k, v in (await request.form()).items()} if request.method == "POST" else {}
        return _Request(request.method, str(request.url), request.headers, form)

    async def authorize(request: Request) -> Response:
        # The person is signed in and consents at once.
        req = await wrap(request)
        grant = server.get_consent_grant(request=req, end_user=USER)
        response: Response = server.create_authorization_response(request=req, grant_user=USER, grant=grant)
        return response

    async def token(request: Request) -> Response:
        req = await wrap(request)
        if req.form.get("grant_type") == "refresh_token" and lab.refresh_delay:
            await asyncio.sleep(lab.refresh_delay)
        response: Response = server.create_token_response(req)
        return response

    async def revoke(request: Request) -> Response:
        response: Response = server.create_endpoint_response("revocation", await wrap(request))
        return response

    async def device_authorization(request: Request) -> Response:
        response: Response = server.create_endpoint_response("device_authorization", await wrap(request))
        return response

    async def device_approve(request: Request) -> Response:
        form = await request.form()
        lab.approved[str(form["user_code"])] = str(form.get("approve", "yes")) == "yes"
        return JSONResponse({"ok": True})

    async def metadata(request: Request) -> Response:
        base = lab.base_url
        return JSONResponse({"issuer": base, "authorization_endpoint": base + "/authorize",
                             "token_endpoint": base + "/token", "revocation_endpoint": base + "/revoke",
                             "device_authorization_endpoint": base + "/device_authorization",
                             "code_challenge_methods_supported": ["S256"]})

    async def whoami(request: Request) -> Response:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        record = lab.tokens.get(value.strip()) if scheme.lower() == "bearer" else None
        if record is None or record.revoked or record.is_expired():
            lab.api_denied += 1
            return JSONResponse({"error": "invalid_token"}, status_code=401)
        lab.api_calls += 1
        return JSONResponse({"user": USER, "expires_in": record.get_expires_in()})

    return Starlette(routes=[
        Route("/authorize", authorize, methods=["GET"]),
        Route("/token", token, methods=["POST"]),
        Route("/revoke", revoke, methods=["POST"]),
        Route("/device_authorization", device_authorization, methods=["POST"]),
        Route("/device/approve", device_approve, methods=["POST"]),
        Route("/.well-known/oauth-authorization-server", metadata, methods=["GET"]),
        Route("/api/whoami", whoami, methods=["GET"]),
    ])


async def start_oauth_server(sock: socket.socket, base_url: str, *, ssl_context: ssl.SSLContext | None = None,
                             expires_in: int = 3600) -> OAuthLab:
    """Serve the authorization server on ``sock`` (bound, not yet listening); ``base_url`` is how clients
    name it (its issuer). With ``ssl_context`` (a server context) it speaks HTTPS."""
    lab = OAuthLab(expires_in=expires_in, base_url=base_url.rstrip("/"))
    config = uvicorn.Config(_app(lab), log_level="warning", lifespan="off")
    config.load()
    config.ssl = ssl_context  # load() done: serve() keeps it
    server = _Server(config)
    lab.server = server
    lab.task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if lab.task.done():
            lab.task.result()
            raise RuntimeError("the OAuth server did not start")
        await asyncio.sleep(0.01)
    return lab


def _lab_certificates(tmp: Path, ip: str, names: list[str]) -> tuple[Path, ssl.SSLContext]:
    """A CA (its PEM at the returned path) and a server context with a leaf for ``names`` and ``ip``."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "capsa oauth lab CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [*(x509.DNSName(n) for n in names), x509.IPAddress(ipaddress.ip_address(ip))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_file, cert_file, key_file = tmp / "lab-ca.pem", tmp / "leaf.pem", tmp / "leaf.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_file, key_file)
    return ca_file, ctx


@dataclass
class OAuthWorld:
    """The authorization server (and its protected API, ``https://<api_name>/api/whoami``) in a namespace
    of its own joined to the host by a veth, with a DNS server naming the API host."""

    lab: OAuthLab
    ns: str
    ip: str
    net: str
    ca_file: Path
    api_name: str

    @property
    def issuer(self) -> str:
        return self.lab.base_url


def _sh(*argv: str, check: bool = True) -> None:
    subprocess.run(list(argv), check=check, capture_output=True, text=True)


@contextlib.asynccontextmanager
async def oauth_world(octet: int, *, expires_in: int = 3600,
                      api_name: str = "api.lab.test") -> AsyncIterator[OAuthWorld]:
    """The OAuth server on HTTPS port 443 of 10.250.<octet>.2 in a test-made namespace (its issuer is
    ``https://10.250.<octet>.2``; its certificate also names ``api_name``), DNS on port 53 there."""
    tag = secrets.token_hex(3)
    ns, veth_root, veth_ns = f"ctest-oa-{tag}", f"cor{tag}", f"con{tag}"
    net, root_ip, ip = f"10.250.{octet}.0/24", f"10.250.{octet}.1", f"10.250.{octet}.2"
    tmp = Path(tempfile.mkdtemp(prefix="capsa-oauth-lab-"))
    _sh("ip", "netns", "add", ns)
    lab: OAuthLab | None = None
    dns: asyncio.DatagramTransport | None = None
    try:
        _sh("ip", "link", "add", veth_root, "type", "veth", "peer", "name", veth_ns, "netns", ns)
        _sh("ip", "addr", "add", f"{root_ip}/24", "dev", veth_root)
        _sh("ip", "link", "set", veth_root, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", veth_ns)
        _sh("ip", "-n", ns, "link", "set", veth_ns, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        ca_file, ctx = _lab_certificates(tmp, ip, [api_name])
        lab = await start_oauth_server(open_listener(ns, ip, 443), f"https://{ip}", ssl_context=ctx,
                                       expires_in=expires_in)
        dns, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: DnsServerProtocol(static_dns_handler({api_name: [ip]})),
            sock=open_listener(ns, ip, 53, socket.SOCK_DGRAM))
        yield OAuthWorld(lab, ns, ip, net, ca_file, api_name)
    finally:
        if dns is not None:
            dns.close()
        if lab is not None:
            await lab.stop()
        _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", veth_root, check=False)
        shutil.rmtree(tmp, ignore_errors=True)

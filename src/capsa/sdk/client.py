"""The connection to a capsa API: one ``httpx.AsyncClient``, auth, and the mapping of failures to exceptions.

Session-level operations live in :mod:`capsa.sdk.session`; this module holds what does not belong to one
session (listing sessions, API keys, health) and the request plumbing every other module goes through.
"""

# The API's `timeout` parameters are the remote deadlines the contract defines, not asyncio timeouts.
# ruff: noqa: ASYNC109

from __future__ import annotations

import builtins
import functools
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, Self

import httpx

from capsa.sdk.approvals import AsyncApprovals
from capsa.sdk.audit import AsyncAudit
from capsa.sdk.config import ClientConfig
from capsa.sdk.connections import AsyncConnectionProviders, AsyncConnections
from capsa.sdk.egress import AsyncSecrets
from capsa.sdk.errors import (
    CapsaAPIError,
    CapsaClientError,
    CapsaConnectionError,
    CapsaTimeoutError,
    UnexpectedResponse,
    error_from_problem,
)
from capsa.sdk.models import ApiKey, SessionInfo, SnapshotInfo, parse, parse_items
from capsa.sdk.nodes import AsyncNodes
from capsa.sdk.paths import seg
from capsa.sdk.resource import Resource
from capsa.sdk.transport import H11Transport

__all__ = ["AsyncClient", "AsyncKeys"]

# A sentinel meaning "use the client's default timeout" (None already means "no timeout" to httpx).
_DEFAULT: Literal["default"] = "default"
TimeoutArg = float | None | Literal["default"]

_PAGE_SIZE = 50


def _sdk_version() -> str:
    try:
        return version("capsa")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0"


def _clean(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if params is None:
        return None
    out: dict[str, Any] = {}
    for k, v in params.items():
        if v is None:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else v
    return out


def _problem_from(response: httpx.Response) -> CapsaAPIError:
    body: dict[str, Any] | None = None
    text = ""
    try:
        parsed = response.json()
        if isinstance(parsed, dict):
            body = parsed
    except (ValueError, UnicodeDecodeError):
        text = response.text[:200].strip()
    return error_from_problem(response.status_code, body, retry_after=response.headers.get("retry-after"),
                              fallback_detail=text or response.reason_phrase)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, made once per process: each client otherwise builds its own (loading
    the CA bundle, 17-40 ms on a loaded 2-core host), and ``AsyncSession.create`` makes a client per
    session. The environment (SSL_CERT_FILE, SSL_CERT_DIR) is read at the first client."""
    return httpx.create_ssl_context()


class AsyncClient:
    """A connection to one capsa API with one key. Cheap to keep around; close it with :meth:`aclose`.

    ``transport`` lets tests (or embedders) send requests to an in-process app (``httpx.ASGITransport``).
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = ClientConfig.resolve(api_url, api_key, timeout)
        headers = {"User-Agent": f"capsa-sdk/{_sdk_version()}"}
        if self.config.api_key is not None:
            key = self.config.api_key
            if not key.isascii() or not key.isprintable() or " " in key:
                raise CapsaClientError("the API key contains characters that cannot be sent in a header")
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(base_url=self.config.api_url + "/v1", headers=headers,
                                       timeout=httpx.Timeout(self.config.timeout),
                                       transport=transport or H11Transport(ssl_context=_tls_context()),
                                       verify=_tls_context())
        self.keys = AsyncKeys(self)
        self.nodes = AsyncNodes(self)
        self.secrets = AsyncSecrets(self)
        self.approvals = AsyncApprovals(self)
        self.connections = AsyncConnections(self)
        self.connection_providers = AsyncConnectionProviders(self)
        self.audit = AsyncAudit(self)

    # -- plumbing -------------------------------------------------------------------------------------

    def _timeout(self, timeout: TimeoutArg) -> httpx.Timeout:
        if timeout == _DEFAULT:
            return httpx.Timeout(self.config.timeout)
        # Long reads (commands, big files) must not be cut by the read timeout, but connecting must still
        # fail fast when the server is down.
        return httpx.Timeout(timeout, connect=self.config.timeout)

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    def _check_open(self) -> None:
        if self._http.is_closed:
            raise CapsaClientError("this connection was closed (the session was closed or disconnected); "
                                   "use Session.connect(id) to work with the session again")

    def _connection_error(self, exc: Exception) -> CapsaConnectionError:
        url = self.config.api_url
        if isinstance(exc, httpx.TimeoutException):
            return CapsaTimeoutError(f"capsa API at {url} did not answer in time ({type(exc).__name__})",
                                     url=url)
        reason = str(exc) or type(exc).__name__
        return CapsaConnectionError(f"cannot reach capsa API at {url}: {reason}", url=url)

    async def request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                      json: Any = None, content: Any = None, headers: Mapping[str, str] | None = None,
                      timeout: TimeoutArg = _DEFAULT) -> httpx.Response:
        """Send one request; return the response if it is a success, else raise the mapped exception."""
        self._check_open()
        try:
            response = await self._http.request(method, path, params=_clean(params), json=json,
                                                content=content, headers=headers,
                                                timeout=self._timeout(timeout))
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise self._connection_error(exc) from None
        if response.is_error:
            raise _problem_from(response)
        return response

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                     json: Any = None, content: Any = None, headers: Mapping[str, str] | None = None,
                     timeout: TimeoutArg = _DEFAULT) -> AsyncIterator[httpx.Response]:
        """Like :meth:`request` but the body is read by the caller inside the ``async with``."""
        self._check_open()
        try:
            async with self._http.stream(method, path, params=_clean(params), json=json, content=content,
                                         headers=headers, timeout=self._timeout(timeout)) as response:
                if response.is_error:
                    await response.aread()
                    raise _problem_from(response)
                yield response
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise self._connection_error(exc) from None

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise UnexpectedResponse(
                f"capsa API at {self.config.api_url} sent a non-JSON answer to {method} {path}") from None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- server ---------------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        data = await self.json("GET", "/health")
        return dict(data)

    async def ready(self) -> bool:
        """True when the server can create sessions; False when it answers ``not_ready``."""
        try:
            await self.request("GET", "/ready")
        except CapsaAPIError as exc:
            if exc.code == "not_ready":
                return False
            raise
        return True

    # -- sessions (records only; use AsyncSession to work inside one) --------------------------------

    async def create_session(self, *, template: str = "base", timeout: int | None = None,
                             idle_timeout: int | None = None, env: Mapping[str, str] | None = None,
                             metadata: Mapping[str, str] | None = None, memory_mib: int | None = None,
                             vcpus: int | None = None, on_timeout: Literal["pause", "close"] | None = None,
                             rolling_snapshots: Mapping[str, Any] | None = None,
                             keep_snapshots: bool | None = None,
                             policy: Mapping[str, Any] | None = None,
                             expose: Sequence[int] | None = None) -> SessionInfo:
        body: dict[str, Any] = {"template": template}
        if expose is not None:
            body["expose"] = list(expose)
        if policy is not None:
            body["policy"] = dict(policy)
        if on_timeout is not None:
            body["on_timeout"] = on_timeout
        if rolling_snapshots is not None:
            body["rolling_snapshots"] = dict(rolling_snapshots)
        if keep_snapshots is not None:
            body["keep_snapshots"] = keep_snapshots
        # Omitted fields take the server's defaults, so the SDK never hard-codes them.
        for name, value in (("timeout", timeout), ("idle_timeout", idle_timeout), ("memory_mib", memory_mib),
                            ("vcpus", vcpus)):
            if value is not None:
                body[name] = value
        if env:
            body["env"] = dict(env)
        if metadata:
            body["metadata"] = dict(metadata)
        # Creation restores (or boots) a VM; give it more than an ordinary request.
        data = await self.json("POST", "/sessions", json=body, timeout=max(self.config.timeout, 300.0))
        return parse(SessionInfo, data)

    async def get_session(self, session_id: str) -> SessionInfo:
        return parse(SessionInfo, await self.json("GET", f"/sessions/{seg(session_id)}"))

    async def iter_sessions(self, *, state: str | None = None, metadata: Mapping[str, str] | None = None,
                            page_size: int = _PAGE_SIZE) -> AsyncIterator[SessionInfo]:
        """Every matching session, following the server's cursors page by page."""
        params: dict[str, Any] = {"state": state, "limit": page_size}
        for k, v in (metadata or {}).items():
            params[f"metadata.{k}"] = v
        cursor: str | None = None
        while True:
            data = await self.json("GET", "/sessions", params={**params, "cursor": cursor})
            for info in parse_items(SessionInfo, data):
                yield info
            cursor = data.get("next_cursor")
            if not isinstance(cursor, str) or not cursor:
                return

    async def list_sessions(self, *, state: str | None = None, metadata: Mapping[str, str] | None = None,
                            limit: int | None = None) -> list[SessionInfo]:
        out: list[SessionInfo] = []
        page = _PAGE_SIZE if limit is None else max(1, min(limit, _PAGE_SIZE))
        async for info in self.iter_sessions(state=state, metadata=metadata, page_size=page):
            if limit is not None and len(out) >= limit:
                break
            out.append(info)
        return out

    async def set_session_timeout(self, session_id: str, timeout: int) -> SessionInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/timeout", json={"timeout": timeout})
        return parse(SessionInfo, data)

    # -- pause, resume, branch, snapshots -----------------------------------------------------------------
    # Each starts or snapshots a VM on the node: give it more than an ordinary request.

    def _slow(self) -> float:
        return max(self.config.timeout, 300.0)

    async def pause_session(self, session_id: str) -> SessionInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/pause", timeout=self._slow())
        return parse(SessionInfo, data)

    async def resume_session(self, session_id: str) -> SessionInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/resume", timeout=self._slow())
        return parse(SessionInfo, data)

    async def branch_session(self, session_id: str, n: int = 1) -> list[SessionInfo]:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/branch", json={"n": n},
                               timeout=self._slow())
        return parse_items(SessionInfo, data)

    async def list_snapshots(self, session_id: str) -> list[SnapshotInfo]:
        return parse_items(SnapshotInfo, await self.json("GET", f"/sessions/{seg(session_id)}/snapshots"))

    async def create_snapshot(self, session_id: str) -> SnapshotInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/snapshots", json={},
                               timeout=self._slow())
        return parse(SnapshotInfo, data)

    async def restore_session(self, session_id: str, snapshot_id: str) -> SessionInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/restore",
                               json={"snapshot_id": snapshot_id}, timeout=self._slow())
        return parse(SessionInfo, data)

    async def close_session(self, session_id: str) -> SessionInfo:
        data = await self.json("POST", f"/sessions/{seg(session_id)}/close",
                               timeout=max(self.config.timeout, 120.0))
        return parse(SessionInfo, data)


class AsyncKeys(Resource):
    """API key management (admin keys only)."""

    async def create(self, tenant: str, *, admin: bool = False, name: str | None = None) -> ApiKey:
        body = {"tenant": tenant, "admin": admin, "name": name}
        return await self._call(ApiKey, "POST", "/keys", json=body)

    async def list(self) -> builtins.list[ApiKey]:
        return await self._list(ApiKey, "/keys")

    async def revoke(self, key_id: str) -> ApiKey:
        return await self._call(ApiKey, "DELETE", f"/keys/{seg(key_id)}")


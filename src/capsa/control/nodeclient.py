"""HTTP client for the node agent API (spec/node.openapi.json), used by the control plane only.

A node URL is ``http(s)://host:port`` or ``unix:///path/to/socket``. Every call carries the node's token.
Failures become :class:`NodeError` with the node's stable error code, or ``node_unreachable``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx

from capsa.common.errors import CapsaError

__all__ = ["NodeClient", "NodeClientPool", "NodeError"]

_PREFIX = "/node/v1"


class NodeError(CapsaError):
    """A node answered with an error, or could not be reached (``node_unreachable``)."""

    def __init__(self, code: str, status: int, detail: str) -> None:
        super().__init__(detail, code=code, status=status)


def _raise_for(response: httpx.Response, body: bytes | None = None) -> None:
    if response.is_success:
        return
    raw = body if body is not None else response.content
    try:
        problem = json.loads(raw)
        code = str(problem.get("code", "node_error"))
        detail = str(problem.get("detail", ""))
    except (ValueError, AttributeError):
        code, detail = "node_error", raw[:200].decode(errors="replace")
    raise NodeError(code, response.status_code, detail)


class NodeClient:
    def __init__(self, url: str, token: str, *, timeout: float = 120.0) -> None:
        if url.startswith("unix://"):
            transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix://"))
            base = "http://node"
        else:
            transport = httpx.AsyncHTTPTransport()
            base = url.rstrip("/")
        self._client = httpx.AsyncClient(
            transport=transport, base_url=base + _PREFIX, timeout=httpx.Timeout(timeout, connect=5.0),
            headers={"Authorization": f"Bearer {token}"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise NodeError("node_unreachable", 503, f"node timed out: {type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise NodeError("node_unreachable", 503, f"node unreachable: {exc}") from exc
        _raise_for(response)
        return response

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self._request(method, path, **kwargs)).json()

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        try:
            async with self._client.stream(method, path, **kwargs) as response:
                if not response.is_success:
                    _raise_for(response, await response.aread())
                yield response
        except httpx.TimeoutException as exc:
            raise NodeError("node_unreachable", 503, f"node timed out: {type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise NodeError("node_unreachable", 503, f"node unreachable: {exc}") from exc

    # -- node ------------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", "/info")
        return result

    # -- sandboxes -------------------------------------------------------------------------------------
    async def create_sandbox(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                             env: Mapping[str, str], *, session_id: str | None = None,
                             policy: Mapping[str, Any] | None = None,
                             secrets: Mapping[str, str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": sandbox_id, "template": template, "memory_mib": memory_mib,
                                "vcpus": vcpus, "env": dict(env)}
        if policy is not None:
            body.update(session_id=session_id, policy=dict(policy), secrets=dict(secrets or {}))
        result: dict[str, Any] = await self._json("POST", "/sandboxes", json=body, timeout=None)
        return result

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        await self._request("DELETE", f"/sandboxes/{sandbox_id}")

    async def list_sandboxes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = (await self._json("GET", "/sandboxes"))["items"]
        return result

    # -- egress ----------------------------------------------------------------------------------------
    async def update_policy(self, sandbox_id: str, policy: Mapping[str, Any],
                            secrets: Mapping[str, str]) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("PUT", f"/sandboxes/{sandbox_id}/policy",
                                                  json={"policy": dict(policy), "secrets": dict(secrets)})
        return result

    async def audit(self, *, after: int, epoch: str | None, limit: int) -> dict[str, Any]:
        params: dict[str, str | int] = {"after": after, "limit": limit}
        if epoch is not None:
            params["epoch"] = epoch
        result: dict[str, Any] = await self._json("GET", "/audit", params=params)
        return result

    # -- snapshots (docs/node-snapshots.md) ------------------------------------------------------------
    async def snapshot_sandbox(self, sandbox_id: str, *, retain: bool = True,
                               labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        body = {"retain": retain, "labels": dict(labels or {})}
        result: dict[str, Any] = await self._json("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body,
                                                  timeout=None)
        return result

    async def pause_sandbox(self, sandbox_id: str, *,
                            labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", f"/sandboxes/{sandbox_id}/pause",
                                                  json={"labels": dict(labels or {})}, timeout=None)
        return result

    async def restore_snapshot(self, snapshot_id: str, sandbox_id: str,
                               env: Mapping[str, str]) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", f"/snapshots/{snapshot_id}/restore",
                                                  json={"id": sandbox_id, "env": dict(env)}, timeout=None)
        return result

    async def branch_snapshot(self, snapshot_id: str, sandbox_ids: list[str],
                              env: Mapping[str, str]) -> list[dict[str, Any]]:
        answer = await self._json("POST", f"/snapshots/{snapshot_id}/branch",
                                  json={"ids": sandbox_ids, "env": dict(env)}, timeout=None)
        result: list[dict[str, Any]] = answer["items"]
        return result

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._request("DELETE", f"/snapshots/{snapshot_id}")

    async def get_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", f"/snapshots/{snapshot_id}")
        return result

    # -- commands --------------------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        # The command's own timeout bounds this call; the node returns once the guest reports.
        result: dict[str, Any] = await self._json("POST", f"/sandboxes/{sandbox_id}/exec", json=dict(body),
                                                  timeout=None)
        return result

    @asynccontextmanager
    async def exec_stream(self, sandbox_id: str,
                          body: Mapping[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        """Yields an iterator over NDJSON lines, once the node has accepted the command."""
        async with self._stream("POST", f"/sandboxes/{sandbox_id}/exec", json=dict(body), timeout=None,
                                headers={"Accept": "application/x-ndjson"}) as response:
            yield response.aiter_lines()

    async def start_process(self, sandbox_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", f"/sandboxes/{sandbox_id}/processes",
                                                  json=dict(body))
        return result

    async def list_processes(self, sandbox_id: str) -> list[dict[str, Any]]:
        answer = await self._json("GET", f"/sandboxes/{sandbox_id}/processes")
        result: list[dict[str, Any]] = answer["items"]
        return result

    async def get_process(self, sandbox_id: str, pid: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", f"/sandboxes/{sandbox_id}/processes/{pid}")
        return result

    async def process_output(self, sandbox_id: str, pid: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", f"/sandboxes/{sandbox_id}/processes/{pid}/output")
        return result

    async def kill_process(self, sandbox_id: str, pid: int, signal: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("POST", f"/sandboxes/{sandbox_id}/processes/{pid}/kill",
                                                  json={"signal": signal})
        return result

    # -- files -----------------------------------------------------------------------------------------
    @asynccontextmanager
    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/files/content", params={"path": path},
                                timeout=None) as response:
            yield response.aiter_raw()

    async def write_file(self, sandbox_id: str, path: str, mode: int | None,
                         body: AsyncIterable[bytes]) -> dict[str, Any]:
        params: dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        result: dict[str, Any] = await self._json("PUT", f"/sandboxes/{sandbox_id}/files/content",
                                                  params=params, content=body, timeout=None)
        return result

    async def list_dir(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = (await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/list", params={"path": path}))["items"]
        return result

    async def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", f"/sandboxes/{sandbox_id}/files/stat",
                                                  params={"path": path})
        return result

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> dict[str, Any]:
        result: dict[str, Any] = await self._json(
            "POST", f"/sandboxes/{sandbox_id}/files/mkdir",
            params={"path": path, "parents": "true" if parents else "false"})
        return result

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._request("DELETE", f"/sandboxes/{sandbox_id}/files",
                            params={"path": path, "recursive": "true" if recursive else "false"})

    @asynccontextmanager
    async def export_archive(self, sandbox_id: str, path: str) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._stream("GET", f"/sandboxes/{sandbox_id}/files/archive", params={"path": path},
                                timeout=None) as response:
            yield response.aiter_raw()

    async def import_archive(self, sandbox_id: str, path: str, body: AsyncIterable[bytes]) -> None:
        await self._request("PUT", f"/sandboxes/{sandbox_id}/files/archive", params={"path": path},
                            content=body, timeout=None)


class NodeClientPool:
    """Keeps one connection pool per node; a cache only, nothing another replica would need."""

    def __init__(self, timeout: float = 120.0) -> None:
        self._timeout = timeout
        self._clients: dict[tuple[str, str], NodeClient] = {}

    def get(self, url: str, token: str) -> NodeClient:
        key = (url, token)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = NodeClient(url, token, timeout=self._timeout)
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

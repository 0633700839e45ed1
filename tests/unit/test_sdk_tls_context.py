"""The SDK builds httpx's TLS context once per process, not once per client: ``AsyncSession.create`` makes a
client per session, and building a context (the CA bundle) cost 17-40 ms each time on a loaded host."""

from __future__ import annotations

import ssl

import httpx
import pytest

from capsa.sdk import client as sdk_client


async def test_clients_share_one_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[ssl.SSLContext] = []
    real = httpx.create_ssl_context

    def counting() -> ssl.SSLContext:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    sdk_client._tls_context.cache_clear()
    try:
        clients = [sdk_client.AsyncClient("https://capsa.example", "csk_x") for _ in range(3)]
        assert len(made) == 1
        for c in clients:
            await c.aclose()
    finally:
        sdk_client._tls_context.cache_clear()

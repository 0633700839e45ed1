"""Approval notifications: what the node POSTs to a policy's ``approval_webhook``.

One :class:`WebhookNotifier` per node. Its destinations are screened like the broker's upstreams
(:func:`capsa.common.destinations.screen_host`: public addresses only, unless the operator's
``CAPSA_WEBHOOK_ALLOW_NETWORKS`` covers them) and pinned for the connection; a policy whose webhook is
refused never reaches a sandbox (:meth:`WebhookNotifier.check`, ``destination_refused``).

Notifications are queued, bounded and coalesced: pending approvals for one URL wait in one batch (at most
:data:`MAX_BATCH` approvals, :data:`MAX_URLS` URLs; beyond that they are dropped and logged — the approval
stays decidable through the API), a URL gets at most one POST in flight and one POST per
``min_interval_s``, and a few workers send them through one shared HTTP client (its TLS context is built
once, in a thread, off the event loop). A burst of held requests therefore makes a few POSTs, not a burst.
Each POST is signed (:mod:`capsa.common.webhook_signature`) when the node has a key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from capsa.common.addresses import IPNetwork
from capsa.common.destinations import DestinationRefused, ResolveError, Resolver, screen_host
from capsa.common.ids import new_id
from capsa.common.pinned_http import pinned_transport
from capsa.common.webhook_signature import DELIVERY_HEADER, sign

__all__ = ["MAX_BATCH", "MAX_URLS", "Notifier", "WebhookNotifier"]

_log = logging.getLogger(__name__)

MAX_BATCH = 100
"""Approvals one notification carries at most; more for the same URL before it is sent are dropped."""
MAX_URLS = 64
"""Distinct webhook URLs with notifications waiting at once; a new URL beyond that is dropped."""
_WORKERS = 2
_TIMEOUT_S = 10.0


class Notifier(Protocol):
    """What the broker and the node ask of approval notifications."""

    async def check(self, url: str) -> None:
        """Raise :class:`DestinationRefused` for a webhook the node will not notify."""
        ...

    def notify(self, url: str, approval: dict[str, Any]) -> bool:
        """Queue a notification (never blocks); False when it was dropped."""
        ...

    async def close(self) -> None: ...


class WebhookNotifier:
    """Sends ``{"type": "approval.pending", "approvals": [...]}`` to webhook URLs, screened, bounded,
    coalesced and signed."""

    def __init__(self, resolver: Resolver, *, allow_networks: Sequence[IPNetwork] = (),
                 secret: bytes | None = None, min_interval_s: float = 1.0,
                 verify: ssl.SSLContext | bool = True, timeout_s: float = _TIMEOUT_S) -> None:
        self.resolver = resolver
        self.allow_networks = tuple(allow_networks)
        self.min_interval_s = min_interval_s
        self._secret = secret
        self._verify = verify
        self._timeout_s = timeout_s
        self._pending: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._busy: set[str] = set()
        self._last_sent: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self._client_lock = asyncio.Lock()
        self.posts = 0
        """POSTs attempted so far."""
        self.dropped = 0
        """Approvals not notified because a bound was reached."""

    def __repr__(self) -> str:
        return f"WebhookNotifier(signed={self._secret is not None})"

    async def check(self, url: str) -> None:
        """Refuse (:class:`DestinationRefused`) a webhook whose host is, or resolves to, a refused address. A
        name that does not resolve now passes: it is screened again on every connection."""
        host = urlsplit(url).hostname
        if not host:
            raise DestinationRefused(f"approval_webhook {url!r} has no host")
        try:
            await screen_host(host, self.resolver, self.allow_networks)
        except ResolveError:
            pass
        except DestinationRefused as exc:
            raise DestinationRefused(f"approval_webhook refused: {exc.message}") from None

    def notify(self, url: str, approval: dict[str, Any]) -> bool:
        """Queue ``approval`` (its API form) for ``url``; False when a bound made it drop it. Never blocks."""
        batch = self._pending.get(url)
        full = len(self._pending) >= MAX_URLS if batch is None else len(batch) >= MAX_BATCH
        if full:
            self.dropped += 1
            _log.warning("approval webhook queue full: approval %s not notified", approval.get("id"))
            return False
        self._pending.setdefault(url, []).append(approval)
        if not self._workers:
            self._workers = [asyncio.create_task(self._work()) for _ in range(_WORKERS)]
        self._wake.set()
        return True

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        self._pending.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- internals -----------------------------------------------------------------------------------

    def _next_url(self) -> str | None:
        return next((url for url in self._pending if url not in self._busy), None)

    async def _work(self) -> None:
        while True:
            url = self._next_url()
            if url is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._busy.add(url)
            try:
                wait = self._last_sent.get(url, float("-inf")) + self.min_interval_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # what arrives meanwhile joins this batch
                batch = self._pending.pop(url, [])
                if batch:
                    self._last_sent[url] = time.monotonic()
                    await self._post(url, batch)
                self._forget_old()
            finally:
                self._busy.discard(url)

    def _forget_old(self) -> None:
        if len(self._last_sent) > 4 * MAX_URLS:
            cutoff = time.monotonic() - self.min_interval_s
            self._last_sent = {u: t for u, t in self._last_sent.items() if t >= cutoff}

    async def _shared_client(self) -> httpx.AsyncClient:
        async with self._client_lock:
            if self._client is None:
                # Loading the CA bundle takes tens of milliseconds: once per node, in a thread.
                verify = self._verify if isinstance(self._verify, ssl.SSLContext) else \
                    await asyncio.to_thread(httpx.create_ssl_context, verify=self._verify)
                self._client = httpx.AsyncClient(
                    transport=pinned_transport(self.resolver, self.allow_networks, verify=verify,
                                               max_connections=_WORKERS, max_keepalive=_WORKERS),
                    timeout=self._timeout_s, follow_redirects=False, trust_env=False,
                    headers={"User-Agent": "capsa-approvals"})
            return self._client

    async def _post(self, url: str, approvals: list[dict[str, Any]]) -> None:
        """One POST; failures are logged, never raised (the approvals stay decidable through the API)."""
        body = json.dumps({"type": "approval.pending", "approvals": approvals},
                          separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: new_id("whd")}
        if self._secret is not None:
            headers.update(sign(self._secret, body))
        self.posts += 1
        client = await self._shared_client()
        try:
            # The answer's body is never read: a receiver cannot make the node buffer anything.
            async with client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code >= 300:
                    _log.warning("approval webhook answered %d", response.status_code)
        except DestinationRefused as exc:
            _log.warning("approval webhook refused: %s", exc.message)
        except ResolveError as exc:
            _log.warning("approval webhook not resolved: %s", exc.message)
        except httpx.HTTPError as exc:
            _log.warning("approval webhook failed: %s", exc.__class__.__name__)

"""Access tokens of connections, as the broker injects them: fetched from the control plane, held
encrypted, fetched again (once, however many requests wait) when due for refresh, forgotten on revoke.

The control plane owns the sign-in: it alone holds the client secret and the refresh token and talks to
the provider's token endpoint (see ARCHITECTURE.md, "Connections"). A node only ever holds short-lived
access tokens of connections its sandboxes' policies bind.

Single flight: the first request that finds a connection's token missing or due starts one fetch; every
request arriving meanwhile awaits that same fetch. A revocation bumps the connection's generation, so a
fetch that was under way when it came is thrown away instead of cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from capsa.common.connection_wire import ConnectionTokenOut, refresh_margin
from capsa.common.errors import CapsaError
from capsa.node.egress.secrets import SecretBox

__all__ = ["ConnectionRevoked", "ConnectionTokens", "TokenFetcher", "TokenUnavailable"]

TokenFetcher = Callable[[str, str], Awaitable[ConnectionTokenOut]]
"""(session id, connection id) -> a current access token, from the control plane."""


class TokenUnavailable(CapsaError):
    code = "connection_token_unavailable"
    status = 503


class ConnectionRevoked(CapsaError):
    code = "connection_revoked"
    status = 403


@dataclass
class _Held:
    blob: bytes
    expires_at: float
    """Monotonic time the token stops being valid."""
    margin: float


@dataclass(frozen=True)
class Issued:
    value: str
    fetched: bool
    """True when this call waited for a fetch from the control plane (first use or refresh)."""


class ConnectionTokens:
    def __init__(self, fetch: TokenFetcher | None = None, *, clock: Callable[[], float] = time.monotonic,
                 fetch_timeout: float = 30.0) -> None:
        self.fetch = fetch
        """Set by whoever links the node to the control plane (the node daemon, or a test)."""
        self._box = SecretBox(os.urandom(32))
        self._clock = clock
        self._timeout = fetch_timeout
        self._held: dict[str, _Held] = {}
        self._flights: dict[str, asyncio.Task[ConnectionTokenOut]] = {}
        self._generation: dict[str, int] = {}
        self._revoked: set[str] = set()
        self._version = 0
        self.fetches = 0
        """Fetches started (for tests and metrics)."""

    def revoked(self, connection_id: str) -> bool:
        return connection_id in self._revoked

    def peek(self, connection_id: str) -> str | None:
        """The held token, whether or not it is due (for redaction of responses)."""
        held = self._held.get(connection_id)
        return self._box.decrypt(connection_id, held.blob) if held is not None else None

    def generation(self) -> int:
        """Changes whenever a held token does (so cached redaction patterns can be rebuilt)."""
        return self._version

    async def current(self, connection_id: str, session_id: str) -> Issued:
        """A token valid for at least its refresh margin; raises ConnectionRevoked or TokenUnavailable."""
        if connection_id in self._revoked:
            raise ConnectionRevoked(f"connection {connection_id} was revoked")
        held = self._held.get(connection_id)
        if held is not None and held.expires_at - self._clock() > held.margin:
            return Issued(self._box.decrypt(connection_id, held.blob), False)
        flight = self._flights.get(connection_id)
        starter = flight is None
        if flight is None:
            if self.fetch is None:
                raise TokenUnavailable("this node has no link to the control plane for connection tokens")
            self.fetches += 1
            flight = asyncio.ensure_future(self._fetch(connection_id, session_id,
                                                       self._generation.get(connection_id, 0)))
            self._flights[connection_id] = flight
            flight.add_done_callback(functools.partial(self._landed, connection_id))
        try:
            # Shielded: one waiter giving up (its client went away) must not cancel everyone's fetch.
            out = await asyncio.shield(flight)
        except CapsaError:
            raise
        except (OSError, TimeoutError) as exc:
            raise TokenUnavailable(f"cannot fetch a token of {connection_id}: {exc.__class__.__name__}") \
                from None
        if connection_id in self._revoked:
            raise ConnectionRevoked(f"connection {connection_id} was revoked")
        return Issued(out.access_token, starter)

    def _landed(self, connection_id: str, flight: asyncio.Task[ConnectionTokenOut]) -> None:
        if self._flights.get(connection_id) is flight:
            del self._flights[connection_id]
        if not flight.cancelled():
            flight.exception()  # retrieved: waiters see it; nobody may be left to

    async def _fetch(self, connection_id: str, session_id: str, generation: int) -> ConnectionTokenOut:
        assert self.fetch is not None
        started = self._clock()
        try:
            out = await asyncio.wait_for(self.fetch(session_id, connection_id), self._timeout)
        except CapsaError as exc:
            if exc.code == "connection_revoked":
                self.revoke(connection_id)
                raise ConnectionRevoked(f"connection {connection_id} was revoked") from None
            raise TokenUnavailable(f"no token for {connection_id}: {exc.code}") from None
        except (OSError, TimeoutError, ValueError) as exc:  # transport failures, malformed answers
            raise TokenUnavailable(f"no token for {connection_id}: {exc.__class__.__name__}") from None
        if self._generation.get(connection_id, 0) == generation and connection_id not in self._revoked:
            self._version += 1
            self._held[connection_id] = _Held(self._box.encrypt(connection_id, out.access_token),
                                              started + out.expires_in, refresh_margin(out.lifetime))
        return out

    def revoke(self, connection_id: str) -> None:
        """Stop at once: drop the held token, refuse every later request; a fetch under way lands
        uncached and its waiters are refused too."""
        self._revoked.add(connection_id)
        self._generation[connection_id] = self._generation.get(connection_id, 0) + 1
        self._version += 1
        self._held.pop(connection_id, None)

    def forget(self, connection_id: str) -> None:
        """No sandbox here binds the connection any more: drop its token (not a revocation)."""
        self._generation[connection_id] = self._generation.get(connection_id, 0) + 1
        self._version += 1
        self._held.pop(connection_id, None)

    def held(self) -> list[str]:
        return list(self._held)

    async def close(self) -> None:
        for flight in list(self._flights.values()):
            flight.cancel()
            with contextlib.suppress(BaseException):
                await flight
        self._flights.clear()
        self._held.clear()

    def __repr__(self) -> str:
        return f"ConnectionTokens({len(self._held)} held)"

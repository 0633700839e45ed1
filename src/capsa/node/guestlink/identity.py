"""What makes a guest restored from a snapshot its own: fresh entropy, the current time, a hostname.

Every restore of one snapshot starts with the same kernel CRNG state; without a forced reseed with host
entropy two clones return identical ``os.urandom`` bytes (RECIPES.md), and the clock is stale by however
long the snapshot sat on disk. :func:`refresh_guest` runs right after a restore; :func:`bind_identity`
when a restored sandbox is handed to a session (the warm pool), with its hostname; :func:`bind_sandbox` is
that for a sandbox (the :data:`IdentityBinder` the template source and the snapshots part use), its
hostname from the sandbox id (:func:`hostname_for`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

__all__ = ["GuestRefresher", "IdentityBinder", "IdentityGuest", "WithGuest", "bind_identity", "bind_sandbox",
           "hostname_for", "refresh_guest"]

S = TypeVar("S")


class GuestRefresher(Protocol):
    """The guest calls made right after a restore."""

    async def reseed(self, entropy: bytes | None = None) -> None: ...

    async def set_clock(self, unix_ns: int | None = None) -> None: ...


class IdentityGuest(GuestRefresher, Protocol):
    """The guest calls that give a restored sandbox its own identity."""

    async def set_hostname(self, name: str) -> None: ...


async def refresh_guest(guest: GuestRefresher, *, entropy: bytes | None = None) -> None:
    """Give a just-restored guest its own RNG state and the current time (both calls at once)."""
    await asyncio.gather(guest.reseed(entropy if entropy is not None else os.urandom(64)), guest.set_clock())


async def bind_identity(guest: IdentityGuest, *, hostname: str | None) -> None:
    """Make a restored sandbox someone's: its own RNG state, the current time and its hostname.

    The reseed at restore time already separated pooled clones from each other; this one makes the
    sandbox's randomness independent of anything that happened while it sat idle in the pool. The three
    calls are independent, so they go out at once (the guest daemon runs requests concurrently): one
    channel round trip instead of three on the create path.
    """
    calls = [guest.reseed(os.urandom(64)), guest.set_clock()]
    if hostname:
        calls.append(guest.set_hostname(hostname))
    await asyncio.gather(*calls)


class WithGuest(Protocol):
    """A sandbox, as far as binding it goes (a :class:`capsa.node.runtime.base.Sandbox` is one)."""

    @property
    def guest(self) -> IdentityGuest: ...


IdentityBinder = Callable[[S, str], Awaitable[None]]
"""Gives a restored sandbox (an ``S``: ``IdentityBinder[Sandbox]``) its identity, hostname given;
:func:`bind_sandbox` for real guests."""


async def bind_sandbox(sandbox: WithGuest, hostname: str) -> None:
    """:func:`bind_identity` on the sandbox's guest."""
    await bind_identity(sandbox.guest, hostname=hostname)


def hostname_for(sandbox_id: str) -> str:
    # Hostnames may not contain '_'.
    return sandbox_id.replace("_", "-")

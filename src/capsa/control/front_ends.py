"""What a front end that the composition root adds (:mod:`capsa.frontends`: E2B, MCP over HTTP) gives the
control plane's app: how to mount itself, and how the request guard checks its requests before their
bodies are read. The control plane imports no front end: it only runs what it is handed here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.datastructures import Headers

from capsa.common.request_guard import BodyRule
from capsa.control.plane import ControlPlane

__all__ = ["CredentialCheck", "FrontEnd", "FrontEndGate", "Lifetime", "PlaneGetter"]

PlaneGetter = Callable[[], ControlPlane]
"""The running control plane (set once the app has started)."""
Lifetime = Callable[[], AbstractAsyncContextManager[None]]
"""What the app's lifespan enters around serving."""
CredentialCheck = Callable[[ControlPlane, str, Headers], Awaitable[None]]
"""Raise ``CapsaError`` unless the request (its path under the front end's prefix, its headers) carries a
credential its route will accept."""


@dataclass(frozen=True)
class FrontEndGate:
    """The request guard's part for a front end's paths."""

    prefix: str
    """The path the front end serves (and anything under it)."""
    check: CredentialCheck | None = None
    """Its credential check; None: an API key in ``Authorization: Bearer``, as ``/v1``."""
    rules: Sequence[BodyRule] = ()
    """Its routes whose bodies may pass ``max_body_bytes``."""


@dataclass(frozen=True)
class FrontEnd:
    """A front end of the control plane: ``install`` routes or mounts it on the app (and returns what
    the app's lifespan must enter, if anything); ``gate`` is how the guard checks its requests."""

    install: Callable[[FastAPI, PlaneGetter], Lifetime | None]
    gate: FrontEndGate | None = None

"""The control plane's FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from importlib.metadata import version

from fastapi import FastAPI

from capsa.common.audit_checkpoint import load_signing_key
from capsa.common.request_limits import RequestLimits
from capsa.control.audit.anchor import Checkpointer, CheckpointSink, FileCheckpointSink
from capsa.control.audit.checkpoints import checkpoint_all, run_checkpoints
from capsa.control.audit.middleware import AuditMiddleware
from capsa.control.auth import KeyCache, ensure_bootstrap_key
from capsa.control.browser.cdp import CdpPages
from capsa.control.front_ends import FrontEnd
from capsa.control.nodes.client import NodeClientPool
from capsa.control.nodes.secrets import node_sealer
from capsa.control.plane import ControlPlane
from capsa.control.ports.hosts import PortHostRouter
from capsa.control.problems import install_problem_handlers
from capsa.control.ratelimit import RateLimiter
from capsa.control.reaper import run_reaper
from capsa.control.request_gate import install_request_guard
from capsa.control.routes import (
    approvals,
    commands,
    files,
    health,
    keys,
    metrics,
    nodes,
    ports,
    sessions,
    snapshots,
    terminals,
)
from capsa.control.routes import audit as audit_routes
from capsa.control.routes import browser as browser_routes
from capsa.control.routes import connections as connection_routes
from capsa.control.routes import egress as egress_routes
from capsa.control.routes import egress_grants as egress_grant_routes
from capsa.control.routes import secrets as secret_routes
from capsa.control.sessions.cache import SessionCache
from capsa.control.sessions.rolling import run_rolling
from capsa.control.settings import ControlSettings
from capsa.control.store.db import create_engine, migrate, session_factory

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _checkpointer(settings: ControlSettings, sink: CheckpointSink | None) -> Checkpointer | None:
    """The audit checkpoint signer, when a signing key is configured; its sink is ``sink`` or the
    append-only file ``CAPSA_AUDIT_CHECKPOINT_FILE`` (default: beside the key)."""
    key_file = settings.audit_signing_key_file
    if key_file is None:
        return None
    path = settings.audit_checkpoint_file or key_file.with_name("audit-checkpoints.jsonl")
    return Checkpointer(load_signing_key(key_file), sink or FileCheckpointSink(path))


def create_app(settings: ControlSettings | None = None,
               on_bootstrap_key: Callable[[str], None] | None = None,
               checkpoint_sink: CheckpointSink | None = None,
               request_limits: RequestLimits | None = None,
               front_ends: Sequence[FrontEnd] = ()) -> FastAPI:
    """Build the app. Startup migrates the database, installs the bootstrap admin key and starts the reaper.

    ``on_bootstrap_key`` receives a freshly generated admin key, the only time it exists in clear.
    ``checkpoint_sink``: where signed audit checkpoints go instead of ``CAPSA_AUDIT_CHECKPOINT_FILE``.
    ``request_limits``: body, concurrency and rate limits (default: ``CAPSA_REQUEST_*``).
    ``front_ends``: what the composition root adds (:func:`capsa.frontends.build_app`: E2B, MCP).
    """
    settings = settings or ControlSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url, settings.sqlite_synchronous)
        plane = ControlPlane(settings=settings, engine=engine, db=session_factory(engine),
                             nodes=NodeClientPool(settings.node_request_timeout),
                             sealer=node_sealer(settings), rates=RateLimiter(settings.rate_lease),
                             keys=KeyCache(settings.key_cache_seconds),
                             sessions=SessionCache(settings.session_cache_seconds),
                             checkpoints=_checkpointer(settings, checkpoint_sink))
        reaper: asyncio.Task[None] | None = None
        rolling: asyncio.Task[None] | None = None
        checkpoints: asyncio.Task[None] | None = None
        try:
            await migrate(engine, plane.sealer.seal if plane.sealer is not None else None)
            async with plane.db() as db:
                plane.bootstrap_key = await ensure_bootstrap_key(db, settings.bootstrap_key,
                                                                 settings.bootstrap_tenant)
            if plane.bootstrap_key and on_bootstrap_key:
                on_bootstrap_key(plane.bootstrap_key)
            app.state.plane = plane
            app.state.cdp_pages = CdpPages()
            if settings.reaper_interval > 0:
                reaper = asyncio.create_task(run_reaper(plane), name="capsa-reaper")
            if settings.rolling_snapshot_interval > 0:
                rolling = asyncio.create_task(run_rolling(plane), name="capsa-rolling-snapshots")
            if plane.checkpoints is not None and settings.audit_checkpoint_interval > 0:
                checkpoints = asyncio.create_task(
                    run_checkpoints(plane, plane.checkpoints, settings.audit_checkpoint_interval),
                    name="capsa-audit-checkpoints")
            async with contextlib.AsyncExitStack() as lifetimes:
                for lifetime in front_lifetimes:
                    await lifetimes.enter_async_context(lifetime())
                yield
        finally:
            for task in (reaper, rolling, checkpoints):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            pages = getattr(app.state, "cdp_pages", None)
            if isinstance(pages, CdpPages):
                await pages.aclose()
            await plane.nodes.aclose()
            await plane.audit.aclose()  # the events of the last requests, before the database closes
            if plane.checkpoints is not None and getattr(app.state, "plane", None) is plane:
                try:  # the heads as this replica leaves them
                    await checkpoint_all(plane, plane.checkpoints)
                except Exception:
                    log.exception("could not checkpoint the audit chains while stopping")
            await engine.dispose()

    app = FastAPI(title="capsa", version=version("capsa"), lifespan=lifespan,
                  description="Self-hostable microVM sandboxes for AI agents (docs/api-contract.md).")
    install_problem_handlers(app)
    if settings.ports_domain:  # ports on hosts of their own, never on the API's origin
        app.add_middleware(PortHostRouter, domain=settings.ports_domain, ports_app=_ports_app(app))
    app.add_middleware(AuditMiddleware, plane=lambda: getattr(app.state, "plane", None))
    for module in (health, sessions, snapshots, commands, files, ports, terminals, keys, nodes):
        app.include_router(module.router, prefix="/v1")
    for egress_module in (secret_routes, egress_routes, egress_grant_routes, approvals, audit_routes,
                          browser_routes):
        app.include_router(egress_module.router, prefix="/v1")
    app.include_router(connection_routes.providers_router, prefix="/v1")
    app.include_router(connection_routes.router, prefix="/v1")
    app.include_router(metrics.router)
    front_lifetimes = [lifetime for front in front_ends
                       if (lifetime := front.install(app, lambda: _plane_of(app))) is not None]
    # Last, so it is the outermost middleware: bodies are bounded and credentials checked before any route.
    install_request_guard(app, settings, request_limits,
                          [front.gate for front in front_ends if front.gate is not None])
    return app


def _ports_app(app: FastAPI) -> FastAPI:
    """The app that ports' own hosts get: the port proxy's routes alone, sharing ``app``'s state."""
    hosted = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    install_problem_handlers(hosted)
    hosted.include_router(ports.proxy_router, prefix="/v1")
    hosted.state = app.state
    return hosted


def _plane_of(app: FastAPI) -> ControlPlane:
    plane = app.state.plane
    assert isinstance(plane, ControlPlane)
    return plane

"""``capsa control``: the control plane alone, serving HTTP until cancelled (nodes join over HTTP).

Run it under :func:`capsa.common.service.run_service`: SIGTERM or SIGINT cancels :func:`run_control`, whose
``finally`` stops the server, which ends the background loops and closes the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI

from capsa.common.audit_checkpoint import ensure_signing_key
from capsa.common.sdnotify import notify
from capsa.common.service import QuietServer, bind_tcp
from capsa.control.nodes.secrets import derive_secret_key
from capsa.control.secretbox import ensure_key_file
from capsa.control.settings import ControlSettings

__all__ = ["AppFactory", "announce_key", "control_settings", "run_control"]


def announce_key(key: str) -> None:
    """A generated bootstrap admin key exists in clear only now: print it once, as ``capsa serve`` does."""
    print(f"capsa: bootstrap admin key (shown once, store it now): {key}", flush=True)


def control_settings(state_dir: Path, database_url: str | None) -> ControlSettings:
    """Settings from ``CAPSA_*``, with the database in ``state_dir`` by default.

    The secret key (node API tokens and users' secrets are sealed with it) is ``CAPSA_SECRET_KEY`` or
    ``CAPSA_SECRET_KEY_FILE`` when set. Otherwise, on a database server (which several replicas may share)
    it is derived from ``CAPSA_BOOTSTRAP_KEY``, so every replica given that key has the same one; with SQLite,
    or without a bootstrap key, it is a key file in ``state_dir`` (made on the first start, 0600). The audit
    checkpoint signing key is ``CAPSA_AUDIT_SIGNING_KEY_FILE``, else ``audit-signing.key`` in ``state_dir``
    (made on the first start, 0600), its checkpoints going to ``audit-checkpoints.jsonl`` beside it.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = database_url or f"sqlite+aiosqlite:///{state_dir}/capsa.db"
    overrides: dict[str, Any] = {"database_url": url}
    if not os.environ.get("CAPSA_SECRET_KEY") and not os.environ.get("CAPSA_SECRET_KEY_FILE"):
        bootstrap = os.environ.get("CAPSA_BOOTSTRAP_KEY")
        if bootstrap and not url.startswith("sqlite"):
            overrides["secret_key"] = derive_secret_key(bootstrap)
        else:
            overrides["secret_key_file"] = ensure_key_file(state_dir / "secret.key")
    if not os.environ.get("CAPSA_AUDIT_SIGNING_KEY_FILE"):
        # Audit checkpoints are signed with a key the database does not hold (0600, made on the first start).
        overrides["audit_signing_key_file"] = ensure_signing_key(state_dir / "audit-signing.key")
    return ControlSettings(**overrides)



class AppFactory(Protocol):
    """Builds the app from its settings and ``on_bootstrap_key`` (the composition root's
    :func:`capsa.frontends.build_app`)."""

    def __call__(self, settings: ControlSettings | None = None,
                 on_bootstrap_key: Callable[[str], None] | None = None) -> FastAPI: ...


async def run_control(host: str, port: int, state_dir: Path, database_url: str | None,
                      build_app: AppFactory) -> None:
    """Serve the control plane's API (``build_app``) on ``host:port`` until cancelled; prints one line once it
    answers, and then tells systemd (``READY=1``; ``STOPPING=1`` when it stops) under a notify unit."""
    # Bind first: a taken port fails before a bootstrap key is generated that would never be shown again.
    listener = bind_tcp(host, port)
    try:
        settings = await asyncio.to_thread(control_settings, state_dir, database_url)
        app = build_app(settings, on_bootstrap_key=announce_key)
        server = QuietServer(uvicorn.Config(app, log_level="warning", log_config=None))
        task = asyncio.create_task(server.serve(sockets=[listener]), name="capsa-control-api")
        try:
            while not server.started:
                if task.done():
                    task.result()  # why it stopped (a database that cannot be reached, a bad key, ...)
                    raise OSError("the control plane stopped before it started")
                await asyncio.sleep(0.05)
            bound = listener.getsockname()
            shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
            print(f"capsa: control plane on http://{shown}:{bound[1]}", flush=True)
            notify("READY=1", f"STATUS=serving on http://{shown}:{bound[1]}")
            # Shielded: a cancellation (SIGTERM, SIGINT) lands here and the finally below stops the server.
            await asyncio.shield(task)
        finally:
            if server.started:
                notify("STOPPING=1")
            if not task.done():
                server.should_exit = True
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        listener.close()

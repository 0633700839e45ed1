"""``capsa control``: the control plane alone; nodes join it with ``capsa node --enrol-token``."""

from __future__ import annotations

import os
from pathlib import Path

import click

from capsa.cli.output import fail
from capsa.common.errors import CapsaError
from capsa.common.settings import Settings
from capsa.control.keys import parse_key

__all__ = ["control"]


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8700, show_default=True,
              help="TCP port (0: any free port, shown in the ready line).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the embedded database and the secret key file live [default: CAPSA_STATE_DIR or "
                   "/var/lib/capsa].")
def control(host: str, port: int, state_dir: Path | None) -> None:
    """Serve the control plane's API until SIGTERM or SIGINT.

    The database is CAPSA_DATABASE_URL (postgresql+asyncpg://… for several replicas), else SQLite in the
    state dir. On the first start the bootstrap admin key is CAPSA_BOOTSTRAP_KEY if set, else a new key that
    is printed once. Replicas sharing a database must share CAPSA_SECRET_KEY too.
    """
    from capsa.common.service import run_service  # heavy imports (FastAPI, SQLAlchemy) only for this command
    from capsa.control.server import run_control
    from capsa.frontends import build_app

    configured_key = os.environ.get("CAPSA_BOOTSTRAP_KEY")
    if configured_key and parse_key(configured_key) is None:
        fail("CAPSA_BOOTSTRAP_KEY must look like csk_<12 chars [0-9a-z]>_<32 chars [0-9A-Za-z]>")
    state = (state_dir or Settings().state_dir).resolve()
    database_url = os.environ.get("CAPSA_DATABASE_URL") or None
    try:
        run_service(run_control(host, port, state, database_url, build_app))
    except (CapsaError, OSError, ValueError) as exc:
        fail(str(exc))

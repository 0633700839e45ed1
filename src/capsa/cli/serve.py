"""``capsa serve``: the control plane and a local node in one process (embedded SQLite by default)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import click

from capsa.cli.output import fail, json_option
from capsa.common.errors import CapsaError
from capsa.common.settings import Settings
from capsa.control.keys import parse_key

__all__ = ["serve"]


def _check_port(host: str, port: int) -> None:
    """Fail early, before the server starts (and before a first-start key is announced), on a bad address.

    The server binds again right after, so this cannot rule out a race; it catches the common mistakes.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        fail(f"cannot serve on {host}:{port}: {exc.strerror}")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}")



@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8700, show_default=True, help="TCP port.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where sessions' VMs, disks and the embedded database live [default: CAPSA_STATE_DIR "
                   "or /var/lib/capsa].")
@click.option("--database-url", envvar="CAPSA_DATABASE_URL", show_envvar=True, default=None,
              help="SQLAlchemy URL (e.g. postgresql+asyncpg://…) [default: SQLite in the state dir].")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default=None,
              help="VM accelerator [default: CAPSA_ACCEL or auto].")
@json_option
def serve(host: str, port: int, state_dir: Path | None, database_url: str | None, accel: str | None,
          as_json: bool) -> None:
    """Serve the capsa API with a local node until interrupted.

    On the first start the bootstrap admin key is CAPSA_BOOTSTRAP_KEY if set, else a new key that is
    printed once; keep it, it cannot be shown again.
    """
    from capsa import serve as server  # heavy imports (FastAPI, SQLAlchemy) only for this command
    from capsa.common.service import run_service
    from capsa.node.statedir import prepare_state_dir

    settings = Settings()
    state = (state_dir or settings.state_dir).resolve()
    chosen_accel = accel or settings.accel
    configured_key = os.environ.get("CAPSA_BOOTSTRAP_KEY")
    if configured_key and parse_key(configured_key) is None:
        fail("CAPSA_BOOTSTRAP_KEY must look like csk_<12 chars [0-9a-z]>_<32 chars [0-9A-Za-z]>")
    _check_port(host, port)
    try:
        state = prepare_state_dir(state)
    except CapsaError as exc:
        fail(str(exc))
    if as_json:
        # Structured server logs are the server's business; --json only makes this banner parseable.
        banner = {"url": f"http://{host}:{port}", "state_dir": str(state), "accel": chosen_accel}
        click.echo(json.dumps(banner), err=True)
    try:
        # SIGTERM and SIGINT cancel the server, whose cleanup then removes every VM, tap and mount.
        run_service(server.run(host, port, state, database_url, chosen_accel))
    except CapsaError as exc:
        fail(str(exc))
    except NotImplementedError as exc:
        fail(str(exc))
    except OSError as exc:
        # e.g. the port is taken: one line, not a traceback
        fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}")

"""Ports of a sandbox from the command line: ``capsa port-forward SESSION PORT [LOCAL]``."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import click

from capsa.cli.output import ApiOptions, emit_json, json_api_options, reports_errors
from capsa.sdk import Session

__all__ = ["port_forward"]


@click.command("port-forward")
@json_api_options
@click.option("--address", default="127.0.0.1", show_default=True, help="Local address to listen on.")
@click.argument("session_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.argument("local_port", required=False, default=0, type=click.IntRange(0, 65535))
def port_forward(as_json: bool, api: ApiOptions, address: str, session_id: str, port: int,
                 local_port: int) -> None:
    """Listen on LOCAL_PORT (default: a free one) and forward each connection to PORT inside SESSION_ID's
    sandbox, through the API (any TCP protocol; the sandbox needs no network). Runs until interrupted."""
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    with reports_errors():
        session = Session.connect(session_id, api_url=api.api_url, api_key=api.api_key)
        try:
            forward = session.ports.forward(port, local_port, host=address)
            try:
                if as_json:
                    emit_json({"session_id": session_id, "port": port, "local_address": forward.local_address,
                               "local_port": forward.local_port})
                else:
                    click.echo(f"Forwarding {forward.local_address} -> {session_id}:{port} (Ctrl-C to stop)")
                signal.signal(signal.SIGTERM, _stop)
                try:
                    while not stop.wait(0.5):
                        pass
                except KeyboardInterrupt:
                    pass
            finally:
                forward.close()
        finally:
            session.disconnect()

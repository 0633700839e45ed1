"""Session snapshots from the command line: ``capsa pause|resume|branch|snapshots``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from capsa.cli.output import (
    ApiOptions,
    emit_items,
    emit_json,
    emit_result,
    human_time,
    json_api_options,
    reports_errors,
)
from capsa.sdk import Session, SessionInfo, SnapshotInfo

__all__ = ["branch", "pause", "resume", "snapshots"]

T = TypeVar("T")

_MAX_BRANCHES = 32  # the API's bound


def _on_session(api: ApiOptions, session_id: str, call: Callable[[Session], T]) -> T:
    """``call(session)`` on the session ``session_id``, which is disconnected again after it (it keeps
    running); an SDK failure ends the command."""
    with reports_errors():
        session = Session.connect(session_id, api_url=api.api_url, api_key=api.api_key)
        try:
            return call(session)
        finally:
            session.disconnect()


def _print_session(info: SessionInfo, as_json: bool) -> None:
    reason = f" ({info.pause_reason})" if info.state == "paused" and info.pause_reason else ""
    emit_result(info, as_json, f"{info.id} {info.state}{reason}")


@click.command("pause")
@json_api_options
@click.argument("session_id")
def pause(as_json: bool, api: ApiOptions, session_id: str) -> None:
    """Snapshot SESSION_ID and stop its sandbox; `capsa resume` continues where it was."""
    _print_session(_on_session(api, session_id, Session.pause), as_json)


@click.command("resume")
@json_api_options
@click.argument("session_id")
def resume(as_json: bool, api: ApiOptions, session_id: str) -> None:
    """Start a new sandbox for the paused SESSION_ID from its latest snapshot."""
    with reports_errors():
        session = Session.resume(session_id, api_url=api.api_url, api_key=api.api_key)
        session.disconnect()
    _print_session(session.info, as_json)


@click.command("branch")
@click.option("-n", "count", type=click.IntRange(1, _MAX_BRANCHES), default=1, show_default=True,
              help="Number of new sessions.")
@json_api_options
@click.argument("session_id")
def branch(count: int, as_json: bool, api: ApiOptions, session_id: str) -> None:
    """Create N new sessions from the current state of SESSION_ID (it keeps running)."""
    children = _on_session(api, session_id, lambda session: session.branch(count))
    infos = [child.info for child in children]
    if as_json:
        emit_json({"items": infos})
        return
    for info in infos:
        click.echo(f"{info.id} {info.state}")


def _snapshot_row(s: SnapshotInfo) -> list[str]:
    return [s.id, s.kind, human_time(s.created_at),
            "-" if s.size_bytes is None else f"{s.size_bytes / (1 << 20):.1f} MiB", s.parent or "-"]


@click.command("snapshots")
@click.option("--take", is_flag=True, help="Take a snapshot now (the session keeps running).")
@click.option("--restore", "restore_id", metavar="SNAPSHOT_ID", default=None,
              help="Roll the session back to this snapshot.")
@json_api_options
@click.argument("session_id")
def snapshots(take: bool, restore_id: str | None, as_json: bool, api: ApiOptions, session_id: str) -> None:
    """List the snapshots of SESSION_ID (newest first), take one, or restore one."""
    if take and restore_id:
        raise click.UsageError("--take and --restore cannot be combined")
    if take:
        taken = _on_session(api, session_id, lambda session: session.snapshots.create())
        emit_result(taken, as_json, taken.id)
    elif restore_id:
        def restore(session: Session) -> SessionInfo:
            session.snapshots.restore(restore_id)
            return session.info

        _print_session(_on_session(api, session_id, restore), as_json)
    else:
        items = _on_session(api, session_id, lambda session: session.snapshots.list())
        emit_items(items, as_json, ["ID", "KIND", "CREATED", "SIZE", "PARENT"], _snapshot_row)

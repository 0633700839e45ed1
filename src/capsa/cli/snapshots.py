"""Session snapshots from the command line: ``capsa pause|resume|branch|snapshots``."""

from __future__ import annotations

import click

from capsa.cli.output import (
    ApiOptions,
    api_options,
    emit_items,
    emit_json,
    human_time,
    json_option,
    reports_errors,
)
from capsa.sdk import Session, SessionInfo, SnapshotInfo

__all__ = ["branch", "pause", "resume", "snapshots"]

_MAX_BRANCHES = 32  # the API's bound


def _session(api: ApiOptions, session_id: str) -> Session:
    return Session.connect(session_id, api_url=api.api_url, api_key=api.api_key)


def _print_session(info: SessionInfo, as_json: bool) -> None:
    if as_json:
        emit_json(info)
    else:
        reason = f" ({info.pause_reason})" if info.state == "paused" and info.pause_reason else ""
        click.echo(f"{info.id} {info.state}{reason}")


@click.command("pause")
@json_option
@api_options
@click.argument("session_id")
def pause(as_json: bool, api: ApiOptions, session_id: str) -> None:
    """Snapshot SESSION_ID and stop its sandbox; `capsa resume` continues where it was."""
    with reports_errors():
        session = _session(api, session_id)
        try:
            info = session.pause()
        finally:
            session.disconnect()
    _print_session(info, as_json)


@click.command("resume")
@json_option
@api_options
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
@json_option
@api_options
@click.argument("session_id")
def branch(count: int, as_json: bool, api: ApiOptions, session_id: str) -> None:
    """Create N new sessions from the current state of SESSION_ID (it keeps running)."""
    with reports_errors():
        session = _session(api, session_id)
        try:
            children = session.branch(count)
        finally:
            session.disconnect()
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
@json_option
@api_options
@click.argument("session_id")
def snapshots(take: bool, restore_id: str | None, as_json: bool, api: ApiOptions, session_id: str) -> None:
    """List the snapshots of SESSION_ID (newest first), take one, or restore one."""
    if take and restore_id:
        raise click.UsageError("--take and --restore cannot be combined")
    with reports_errors():
        session = _session(api, session_id)
        try:
            if take:
                taken = session.snapshots.create()
            elif restore_id:
                session.snapshots.restore(restore_id)
            else:
                items = session.snapshots.list()
        finally:
            session.disconnect()
    if take:
        if as_json:
            emit_json(taken)
        else:
            click.echo(taken.id)
    elif restore_id:
        _print_session(session.info, as_json)
    else:
        emit_items(items, as_json, ["ID", "KIND", "CREATED", "SIZE", "PARENT"], _snapshot_row)

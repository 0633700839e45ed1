"""``capsa audit``: the tenant audit chain (``verify``, ``export``) and, as before, ``capsa audit
SESSION_ID`` (alias ``capsa audit show``) for one session's egress trail."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import IO

import click

from capsa.cli.egress import audit as session_audit
from capsa.cli.output import (
    ApiOptions,
    api_options,
    emit_json,
    emit_result,
    fail,
    json_api_options,
    reports_errors,
)
from capsa.common.audit_chain import verify_export
from capsa.sdk import AUDIT_KINDS

__all__ = ["audit"]


class _AuditGroup(click.Group):
    """Subcommands, or a session id: ``capsa audit ses_...`` keeps showing that session's egress trail."""

    def resolve_command(self, ctx: click.Context, args: list[str]
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            return "show", self.commands["show"], args
        return super().resolve_command(ctx, args)


@click.group(cls=_AuditGroup)
def audit() -> None:
    """The tenant's tamper-evident audit chain; `capsa audit SESSION_ID` shows a session's egress trail."""


audit.add_command(session_audit, name="show")


@audit.command("verify")
@click.option("--file", "export_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Check this export (JSON lines of `capsa audit export`) offline instead "
                                 "of asking the server.")
@json_api_options
def verify(export_file: Path | None, as_json: bool, api: ApiOptions) -> None:
    """Check the caller's tenant chain against the signed checkpoints outside the database (or an
    exported file); exits 1 naming the first missing or altered event, or a cut tail."""
    if export_file is not None:
        with export_file.open(encoding="utf-8") as lines:
            try:
                offline = verify_export(json.loads(line) for line in lines if line.strip())
            except ValueError as exc:
                fail(f"{export_file} is not JSON lines: {exc}")
                return
        ok, checked, broken, reason = offline.ok, offline.checked, offline.broken_id, offline.reason
        head, code, anchor = None, None, None
        if as_json:
            emit_json({"ok": ok, "checked": checked, "broken_id": broken, "reason": reason})
    else:
        result = api.call(lambda client: client.audit.verify())
        ok, checked, broken, reason, head = result.ok, result.checked, result.broken_id, result.reason, \
            result.head
        code, anchor = result.code, result.anchor
        if as_json:
            emit_json(result)
    if not ok:
        if code == "audit_checkpoint_invalid":
            fail(f"audit checkpoints do not check out: {reason}")
        what = "truncated" if code == "audit_chain_truncated" else "broken"
        fail(f"audit chain {what} at event {broken}: {reason} ({checked} events checked before it)")
    if not as_json:
        anchored = "" if export_file is not None else (
            f", anchored by a signed checkpoint at event {anchor}" if anchor is not None
            else " (no signed checkpoint yet: a cut tail would not be detected)")
        click.echo(f"ok: {checked} events" + (f", head {head}" if head is not None else "") + anchored)


@audit.command("checkpoint")
@json_api_options
def checkpoint(as_json: bool, api: ApiOptions) -> None:
    """Have the control plane sign the chain's head into its anchor outside the database now."""
    result = api.call(lambda client: client.audit.checkpoint())
    emit_result(result, as_json, f"checkpoint {result.n}: event {result.seq} ({result.hash[:16]}…) signed by "
                                 f"key {result.key} at {result.time.isoformat(timespec='seconds')}")


_Time = click.DateTime(formats=["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z",
                                "%Y-%m-%d %H:%M:%S"])


@audit.command("export")
@click.option("--session", "session_id", default=None, help="Only this session's events.")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(AUDIT_KINDS),
              help="Only events of this kind (repeatable).")
@click.option("--since", type=_Time, default=None, help="Events at or after this time (UTC unless given).")
@click.option("--until", type=_Time, default=None, help="Events before this time (UTC unless given).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write here instead of stdout.")
@api_options
def export(session_id: str | None, kinds: tuple[str, ...], since: datetime | None, until: datetime | None,
           output: Path | None, api: ApiOptions) -> None:
    """Write the chain's events as JSON lines (one object per event, with its `kind`, `hash` and
    `prev_hash`), oldest first."""
    count = 0
    with reports_errors(), api.client() as client:
        sink: IO[str] = output.open("w", encoding="utf-8") if output is not None else sys.stdout
        try:
            records = client.audit.iter(session_id=session_id, kind=list(kinds), since=since, until=until)
            for record in records:
                sink.write(json.dumps(record.model_dump(mode="json"), sort_keys=True) + "\n")
                count += 1
        finally:
            if output is not None:
                sink.close()
    if output is not None:
        click.echo(f"wrote {count} events to {output}", err=True)

"""``capsa secrets`` (create, ls, rm), ``capsa audit ID`` and ``capsa policy`` (show, set)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
import yaml

from capsa.cli.output import (
    ApiOptions,
    api_options,
    emit_items,
    emit_json,
    emit_made,
    fail,
    human_time,
    json_api_options,
    listing_command,
    reports_errors,
)
from capsa.sdk import AuditEvent, Session

__all__ = ["audit", "policy", "secrets"]


@click.group()
def secrets() -> None:
    """Secrets the egress broker injects for sessions (values are write-only)."""


def _read_value(from_env: str | None) -> str:
    # Never from a command-line argument: it would land in shell history and in `ps`.
    if from_env is not None:
        value = os.environ.get(from_env)
        if value is None:
            fail(f"environment variable {from_env} is not set")
        assert value is not None
        return value
    if sys.stdin.isatty():
        return str(click.prompt("secret value", hide_input=True, confirmation_prompt=True))
    return sys.stdin.read().rstrip("\r\n")


@secrets.command("create")
@click.argument("name")
@click.option("--from-env", metavar="VAR", default=None,
              help="Take the value from this environment variable (default: stdin, or a hidden prompt).")
@click.option("--description", default=None, help="What the secret is for.")
@json_api_options
def create(name: str, from_env: str | None, description: str | None, as_json: bool, api: ApiOptions) -> None:
    """Store a secret NAME. Its value is never shown again, by any command."""
    value = _read_value(from_env)
    if not value:
        fail("the secret value is empty")
    info = api.call(lambda client: client.secrets.create(name, value, description=description))
    emit_made(info, as_json, info.id,
              f"stored secret {info.name!r}; bind it in a policy as {{\"secret\": \"{info.name}\", ...}}")


listing_command(secrets, "List secrets (names and ids, never values).", lambda client: client.secrets.list(),
                ["ID", "NAME", "DESCRIPTION", "CREATED"],
                lambda s: [s.id, s.name, s.description or "-", human_time(s.created_at)])


@secrets.command("rm")
@click.argument("secrets_", nargs=-1, required=True, metavar="NAME_OR_ID...")
@api_options
def rm(secrets_: tuple[str, ...], api: ApiOptions) -> None:
    """Delete secrets. Running sessions bound to one keep it until they end."""
    with reports_errors(), api.client() as client:
        for ref in secrets_:
            client.secrets.delete(ref)
            click.echo(f"deleted {ref}", err=True)


@click.command("audit")
@click.argument("session_id")
@click.option("--decision", type=click.Choice(["allow", "deny", "error"]), default=None,
              help="Only events with this decision.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many events.")
@json_api_options
def audit(session_id: str, decision: str | None, limit: int | None, as_json: bool, api: ApiOptions) -> None:
    """Show a session's egress audit trail: requests, DNS queries and dropped packets, oldest first."""
    events = api.call(lambda client: Session.connect(session_id, client=client).egress.audit(
        decision=decision, limit=limit))
    emit_items(events, as_json, ["ID", "TIME", "KIND", "DECISION", "REQUEST", "STATUS", "SECRETS", "WHY"],
               _audit_row)


def _audit_row(e: AuditEvent) -> list[str]:
    what = " ".join(p for p in (e.method, e.destination, e.path) if p) or "-"
    if e.kind == "net" and e.count > 1:
        what += f" (x{e.count})"
    return [str(e.id), e.time.astimezone().strftime("%H:%M:%S"), e.kind, e.decision, what,
            str(e.status) if e.status is not None else "-", ",".join(e.secret_ids) or "-",
            e.reason or e.rule or "-"]


@click.group()
def policy() -> None:
    """A session's egress policy."""


@policy.command("show")
@click.argument("session_id")
@json_api_options
def show(session_id: str, as_json: bool, api: ApiOptions) -> None:
    """Print the session's policy (YAML; --json for JSON)."""
    info = api.call(lambda client: Session.connect(session_id, client=client).egress.policy())
    if as_json:
        emit_json(info)
    elif info.policy is None:
        click.echo("no policy: this session has no network")
    else:
        click.echo(yaml.safe_dump(info.policy, sort_keys=False), nl=False)


@policy.command("set")
@click.argument("session_id")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@json_api_options
def set_(session_id: str, file: Path, as_json: bool, api: ApiOptions) -> None:
    """Replace a running session's policy with FILE (JSON or YAML; - for stdin). No restart needed."""
    text = sys.stdin.read() if str(file) == "-" else file.read_text()
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        fail(f"{file}: neither JSON nor YAML: {exc}")
    if not isinstance(document, dict):
        fail(f"{file}: a policy is a mapping")
    info = api.call(lambda client: Session.connect(session_id, client=client).egress.set_policy(document))
    if as_json:
        emit_json(info)
        return
    note = " (new CA installed in the sandbox)" if info.ca_reissued else ""
    click.echo(f"policy of {session_id} updated{note}", err=True)
    if info.policy is not None:
        click.echo(json.dumps(info.policy, indent=2))

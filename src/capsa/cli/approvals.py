"""``capsa approvals`` (ls, approve, deny): egress requests held for a decision."""

from __future__ import annotations

import click

from capsa.cli.output import ApiOptions, emit_items, emit_result, human_time, json_api_options

__all__ = ["approvals"]


@click.group()
def approvals() -> None:
    """Egress requests a session's policy holds until someone approves or denies them."""


@approvals.command("ls")
@click.option("--session", "session_id", metavar="ID", default=None, help="Only this session's approvals.")
@click.option("--all", "include_decided", is_flag=True, help="Also the ones decided recently.")
@json_api_options
def ls(session_id: str | None, include_decided: bool, as_json: bool, api: ApiOptions) -> None:
    """List pending approvals, oldest first."""
    items = api.call(lambda client: client.approvals.list(session_id=session_id,
                                                          include_decided=include_decided))
    emit_items(items, as_json, ["ID", "SESSION", "STATE", "REQUEST", "RULE", "BODY", "EXPIRES"],
               lambda a: [a.id, a.session_id, a.state, f"{a.method} {a.destination}{a.path}", a.approval_rule,
                          f"{a.body_bytes} B", human_time(a.expires_at)])


@approvals.command("approve")
@click.argument("approval_id", metavar="ID")
@click.option("--session-scope", is_flag=True,
              help="Also let later requests of the session that this rule matches through without asking.")
@click.option("--reason", default=None, help="Recorded in the audit trail.")
@json_api_options
def approve(approval_id: str, session_scope: bool, reason: str | None, as_json: bool,
            api: ApiOptions) -> None:
    """Let the held request ID through; the sandbox gets the upstream's answer."""
    info = api.call(lambda client: client.approvals.approve(
        approval_id, scope="session" if session_scope else None, reason=reason))
    emit_result(info, as_json,
                f"approved {info.id} ({info.method} {info.destination}{info.path}, scope {info.scope})")


@approvals.command("deny")
@click.argument("approval_id", metavar="ID")
@click.option("--reason", default=None,
              help="Told to the sandbox in the 403 and recorded in the audit trail.")
@json_api_options
def deny(approval_id: str, reason: str | None, as_json: bool, api: ApiOptions) -> None:
    """Refuse the held request ID; the sandbox gets a 403 naming the approval."""
    info = api.call(lambda client: client.approvals.deny(approval_id, reason=reason))
    emit_result(info, as_json, f"denied {info.id} ({info.method} {info.destination}{info.path})")

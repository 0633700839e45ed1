"""Session commands: ``capsa run``, ``capsa ls``, ``capsa exec``, ``capsa close``.

``run`` and ``exec`` exit with the remote command's exit code (128+N when killed by signal N, 124 on
timeout), so capsa's own failures use 125, as ``docker run`` does, to stay distinguishable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO, get_args

import click
import yaml

from capsa.cli.output import (
    ApiOptions,
    emit_items,
    emit_json,
    fail,
    human_time,
    json_api_options,
    reports_errors,
)
from capsa.sdk import CommandResult, Session
from capsa.sdk.models import SessionState

__all__ = ["close", "exec_", "ls", "run"]

EXIT_CAPSA_ERROR = 125
EXIT_TIMEOUT = 124
# A session created by `capsa run` outlives its command by this much, so the server reaps it even if the
# CLI is killed before it can close the session.
_SESSION_GRACE = 120
_MAX_SESSION_TIMEOUT = 86400  # the API's upper bound for a session's lifetime


def _parse_env(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", ctx=ctx, param=param)
        env[key] = value
    return env


def _command(args: Sequence[str]) -> str | list[str]:
    # One argument is a shell command line (`capsa run -- 'ls | wc -l'`); several are an argv.
    return args[0] if len(args) == 1 else list(args)


def _read_stdin(interactive: bool) -> str | None:
    if not interactive:
        return None
    return sys.stdin.read()


def _write(stream: TextIO) -> Callable[[str], None]:
    def emit(data: str) -> None:
        stream.write(data)
        stream.flush()

    return emit


def _exit_status(result: CommandResult) -> int:
    if result.timed_out:
        click.echo("error: command timed out", err=True)
        return EXIT_TIMEOUT
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None:
        return 128 + result.signal
    return EXIT_CAPSA_ERROR


def _execute(session: Session, args: Sequence[str], *, timeout: float | None, env: dict[str, str],
             cwd: str | None, user: str | None, stdin: str | None, as_json: bool) -> int:
    if as_json:
        result = session.commands.run(_command(args), timeout=timeout, env=env, cwd=cwd, user=user,
                                      stdin=stdin)
        emit_json({"session_id": session.id, **result.model_dump(mode="json")})
    else:
        # Streamed output reaches the terminal in full; only the copy kept in `result` is bounded.
        result = session.commands.run(_command(args), timeout=timeout, env=env, cwd=cwd, user=user,
                                      stdin=stdin, on_stdout=_write(sys.stdout), on_stderr=_write(sys.stderr))
    return _exit_status(result)


_cmd_options = [
    click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
                 help="Seconds before the command is killed."),
    click.option("--env", "-e", "env", multiple=True, callback=_parse_env, metavar="KEY=VALUE",
                 help="Environment variable for the command (repeatable)."),
    click.option("--cwd", default=None, help="Working directory inside the sandbox."),
    click.option("--user", default=None, help="User to run as inside the sandbox."),
    click.option("--interactive", "-i", is_flag=True, help="Send this process's stdin to the command."),
]


def _with_cmd_options(func: Any) -> Any:
    for option in reversed(_cmd_options):
        func = option(func)
    return func


def _load_policy(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        fail(f"{path}: cannot read the policy: {exc}", EXIT_CAPSA_ERROR)
    if not isinstance(document, dict):
        fail(f"{path}: a policy is a mapping", EXIT_CAPSA_ERROR)
    return {str(k): v for k, v in document.items()}


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--template", "-t", default="base", show_default=True, help="Template to start from.")
@click.option("--memory", "memory_mib", type=click.IntRange(min=1), default=None, help="Memory in MiB.")
@click.option("--vcpus", type=click.IntRange(min=1), default=None, help="Number of vCPUs.")
@click.option("--metadata", "-m", "metadata", multiple=True, callback=_parse_env, metavar="KEY=VALUE",
              help="Metadata label for the session (repeatable).")
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Egress policy (JSON or YAML file); without one the session has no network.")
@_with_cmd_options
@json_api_options
@click.argument("command", nargs=-1, required=True)
def run(template: str, memory_mib: int | None, vcpus: int | None, metadata: dict[str, str],
        policy_file: Path | None, timeout: float, env: dict[str, str], cwd: str | None, user: str | None,
        interactive: bool, as_json: bool, api: ApiOptions, command: tuple[str, ...]) -> None:
    """Create a session, run COMMAND in it (output streamed), close it, exit with its exit code.

    A single COMMAND argument runs under /bin/sh -c; several run as an argv:

        capsa run -- python3 -c 'print(1)'      capsa run -- 'ls / | wc -l'
    """
    policy = _load_policy(policy_file) if policy_file is not None else None
    stdin = _read_stdin(interactive)
    status = EXIT_CAPSA_ERROR
    lifetime = min(int(timeout) + _SESSION_GRACE, _MAX_SESSION_TIMEOUT)
    with reports_errors(EXIT_CAPSA_ERROR), Session.create(
            template, timeout=lifetime, env=env, metadata=metadata, memory_mib=memory_mib, vcpus=vcpus,
            policy=policy, api_url=api.api_url, api_key=api.api_key) as session:
        status = _execute(session, command, timeout=timeout, env={}, cwd=cwd, user=user, stdin=stdin,
                          as_json=as_json)
    sys.exit(status)


@click.command("exec")
@_with_cmd_options
@json_api_options
@click.argument("session_id")
@click.argument("command", nargs=-1, required=True)
def exec_(timeout: float, env: dict[str, str], cwd: str | None, user: str | None, interactive: bool,
          as_json: bool, api: ApiOptions, session_id: str, command: tuple[str, ...]) -> None:
    """Run COMMAND in the existing session SESSION_ID and exit with its exit code."""
    stdin = _read_stdin(interactive)
    status = EXIT_CAPSA_ERROR
    with reports_errors(EXIT_CAPSA_ERROR):
        session = Session.connect(session_id, api_url=api.api_url, api_key=api.api_key)
        try:
            status = _execute(session, command, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin,
                              as_json=as_json)
        finally:
            session.disconnect()
    sys.exit(status)


@click.command("ls")
@click.option("--state", type=click.Choice(list(get_args(SessionState))), default=None,
              help="Only sessions in this state.")
@click.option("--metadata", "-m", "metadata", multiple=True, callback=_parse_env, metavar="KEY=VALUE",
              help="Only sessions with this metadata label (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many sessions.")
@json_api_options
def ls(state: str | None, metadata: dict[str, str], limit: int | None, as_json: bool,
       api: ApiOptions) -> None:
    """List this tenant's sessions."""
    with reports_errors():
        sessions = Session.list(state=state, metadata=metadata, limit=limit, api_url=api.api_url,
                                api_key=api.api_key)
    emit_items(sessions, as_json, ["ID", "STATE", "TEMPLATE", "CREATED", "EXPIRES", "METADATA"],
               lambda s: [s.id, s.state, s.template, human_time(s.created_at), human_time(s.expires_at),
                          ",".join(f"{k}={v}" for k, v in sorted(s.metadata.items())) or "-"])


@click.command("close")
@json_api_options
@click.argument("session_ids", nargs=-1, required=True, metavar="SESSION_ID...")
def close(as_json: bool, api: ApiOptions, session_ids: tuple[str, ...]) -> None:
    """Close sessions (their sandboxes are destroyed)."""
    closed = []
    with reports_errors():
        for session_id in session_ids:
            session = Session.connect(session_id, api_url=api.api_url, api_key=api.api_key)
            info = session.close()
            closed.append(info)
            if not as_json:
                click.echo(f"{info.id} {info.state}")
    if as_json:
        emit_json({"items": closed})

"""``capsa nodes``: list the nodes, make one-time enrolment tokens for new ones, drain and undrain a node
(needs an admin key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from capsa.cli.output import ApiOptions, emit_json, emit_made, human_time, json_api_options, listing_command

__all__ = ["nodes"]


@click.group()
def nodes() -> None:
    """Manage nodes (admin only)."""


def _node_command(name: str) -> Callable[[Callable[..., Any]], click.Command]:
    """Make ``capsa nodes NAME NODE_ID`` (with ``--json`` and the API options) of the decorated function."""

    def make(func: Callable[..., Any]) -> click.Command:
        return nodes.command(name)(click.argument("node_id")(json_api_options(func)))

    return make


@nodes.command("token")
@click.option("--ttl", "ttl_seconds", type=click.IntRange(60, 7 * 86400), default=None,
              help="Seconds the token stays valid (default: one hour).")
@json_api_options
def token(ttl_seconds: int | None, as_json: bool, api: ApiOptions) -> None:
    """Make a one-time enrolment token for `capsa node --enrol-token`."""
    made = api.call(lambda client: client.nodes.create_token(ttl_seconds=ttl_seconds))
    # `T=$(capsa nodes token)` gets the token alone.
    emit_made(made, as_json, made.token,
              f"one-time node enrolment token, valid until {human_time(made.expires_at)}")


def _usage(used: dict[str, int], capacity: dict[str, int], used_key: str, cap_key: str) -> str:
    return f"{used.get(used_key, 0)}/{capacity.get(cap_key, 0)}"


listing_command(nodes, "List the nodes with their health, capacity and use.",
                lambda client: client.nodes.list(),
                ["ID", "NAME", "URL", "HEALTHY", "SANDBOXES", "MEMORY MIB", "VCPUS", "EGRESS", "TEMPLATES",
                 "LAST HEARTBEAT"],
                lambda n: [n.id, n.name or "-", n.url, "yes" if n.healthy else "no",
                           _usage(n.used, n.capacity, "sandboxes", "max_sandboxes"),
                           _usage(n.used, n.capacity, "memory_mib", "memory_mib"),
                           _usage(n.used, n.capacity, "vcpus", "vcpus"), "yes" if n.egress else "no",
                           ",".join(n.templates) or "-", human_time(n.last_heartbeat_at)])


@_node_command("drain")
def drain(node_id: str, as_json: bool, api: ApiOptions) -> None:
    """Move every running session off NODE_ID (memory, processes, files) and give it no new ones."""
    done = api.call(lambda client: client.nodes.drain(node_id))
    if as_json:
        emit_json(done)
        return
    for session_id in done.moved:
        click.echo(f"moved {session_id}")
    for stayed in done.stayed:
        click.echo(f"stayed {stayed.session_id} (paused): {stayed.reason}")
    click.echo(f"node {node_id} {'drained' if done.drained else 'still holds sessions'}", err=True)


@_node_command("undrain")
def undrain(node_id: str, as_json: bool, api: ApiOptions) -> None:
    """Let NODE_ID take new sessions again."""
    node = api.call(lambda client: client.nodes.undrain(node_id))
    if as_json:
        emit_json(node)
    else:
        click.echo(f"node {node_id} takes new sessions again", err=True)

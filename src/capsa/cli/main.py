"""The ``capsa`` command. Each command group lives in its own module and is registered here."""

from __future__ import annotations

import importlib

import click

__all__ = ["cli", "main"]

# (module, attribute) of every top-level command; imported lazily so `capsa --help` stays fast and a
# broken optional dependency of one command does not break the others.
_COMMANDS: dict[str, tuple[str, str]] = {
    "image": ("capsa.cli.image", "image"),
    "template": ("capsa.cli.template", "template"),
    "vm": ("capsa.cli.vm", "vm"),
    "serve": ("capsa.cli.serve", "serve"),
    "node": ("capsa.cli.node", "node"),
    "doctor": ("capsa.cli.doctor", "doctor"),
    "keys": ("capsa.cli.keys", "keys"),
    "nodes": ("capsa.cli.nodes", "nodes"),
    "control": ("capsa.cli.control", "control"),
    "run": ("capsa.cli.sessions", "run"),
    "ls": ("capsa.cli.sessions", "ls"),
    "exec": ("capsa.cli.sessions", "exec_"),
    "close": ("capsa.cli.sessions", "close"),
    "pause": ("capsa.cli.snapshots", "pause"),
    "resume": ("capsa.cli.snapshots", "resume"),
    "branch": ("capsa.cli.snapshots", "branch"),
    "snapshots": ("capsa.cli.snapshots", "snapshots"),
    "secrets": ("capsa.cli.egress", "secrets"),
    "connections": ("capsa.cli.connections", "connections"),
    "audit": ("capsa.cli.audit", "audit"),
    "policy": ("capsa.cli.egress", "policy"),
    "approvals": ("capsa.cli.approvals", "approvals"),
    "port-forward": ("capsa.cli.ports", "port_forward"),
    "e2b": ("capsa.cli.e2b", "e2b"),
    "shell": ("capsa.cli.shell", "shell"),
    "mcp": ("capsa.cli.mcp", "mcp"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module, attr = _COMMANDS[cmd_name]
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="capsa")
def cli() -> None:
    """capsa: microVM sandboxes for AI agents."""


def main() -> None:
    """The ``capsa`` process: every command logs through :func:`capsa.common.logs.configure` (to stderr:
    stdout carries results, such as ``--json`` output, keys and ids, that scripts parse)."""
    from capsa.common.logs import configure

    configure()
    cli()

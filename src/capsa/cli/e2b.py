"""``capsa e2b env``: the environment that points the stock E2B SDK at this capsa."""

from __future__ import annotations

import shlex

import click

from capsa.cli.output import ApiOptions, emit_json, json_api_options
from capsa.sdk.config import ClientConfig
from capsa.sdk.e2b import e2b_environment

__all__ = ["e2b"]


@click.group()
def e2b() -> None:
    """E2B compatibility (docs/e2b.md)."""


@e2b.command("env")
@json_api_options
def env(as_json: bool, api: ApiOptions) -> None:
    """Print `export NAME=value` lines for the E2B SDK: capsa's API URL and the current API key.

    Use as: eval "$(capsa e2b env)"."""
    config = ClientConfig.resolve(api.api_url, api.api_key)
    try:
        values = e2b_environment(config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        emit_json(values)
        return
    for name, value in values.items():
        click.echo(f"export {name}={shlex.quote(value)}")

"""``capsa connections`` (add, login, ls, revoke, providers): OAuth 2.0 sign-ins held by the control plane,
whose access tokens the egress broker injects for sessions whose policy binds them."""

from __future__ import annotations

import os
import sys

import click

from capsa.cli.output import (
    ApiOptions,
    emit_json,
    emit_made,
    fail,
    human_time,
    json_api_options,
    listing_command,
    reports_errors,
)

__all__ = ["connections"]


@click.group()
def connections() -> None:
    """OAuth 2.0 connections: a person signs in once; sessions get the token injected, never see it."""


def _client_secret(from_env: str | None, from_stdin: bool) -> str | None:
    # Never from a command-line argument: it would land in shell history and in `ps`.
    if from_env is not None:
        value = os.environ.get(from_env)
        if not value:
            fail(f"environment variable {from_env} is not set")
        return value
    if from_stdin:
        value = sys.stdin.read().strip()
        if not value:
            fail("no client secret on stdin")
        return value
    return None


@connections.command("add")
@click.argument("name")
@click.option("--provider", default=None, help="An existing provider (id or name) to connect to.")
@click.option("--issuer", default=None, help="Register a provider found by discovery from this issuer URL.")
@click.option("--authorization-endpoint", default=None)
@click.option("--token-endpoint", default=None)
@click.option("--revocation-endpoint", default=None)
@click.option("--device-endpoint", "device_endpoint", default=None,
              help="The device authorization endpoint (for `login --device`).")
@click.option("--client-id", default=None, help="The OAuth client id (with a new provider).")
@click.option("--client-secret-from-env", "secret_env", metavar="VAR", default=None,
              help="Take the client secret from this environment variable.")
@click.option("--client-secret-stdin", "secret_stdin", is_flag=True,
              help="Read the client secret from stdin.")
@click.option("--scope", "scopes", multiple=True, help="A scope to ask for (repeat).")
@json_api_options
def add(name: str, provider: str | None, issuer: str | None, authorization_endpoint: str | None,
        token_endpoint: str | None, revocation_endpoint: str | None, device_endpoint: str | None,
        client_id: str | None, secret_env: str | None, secret_stdin: bool, scopes: tuple[str, ...],
        as_json: bool, api: ApiOptions) -> None:
    """Add connection NAME to --provider, or register a provider named NAME first (--issuer for
    discovery, or the endpoints, with --client-id and the client secret) and connect to it."""
    new_provider = issuer is not None or token_endpoint is not None
    if new_provider == (provider is not None):
        fail("give --provider (an existing one) or --issuer/--token-endpoint (a new one), not both")
    if new_provider and not client_id:
        fail("a new provider needs --client-id")
    secret = _client_secret(secret_env, secret_stdin)
    with reports_errors(), api.client() as client:
        if new_provider:
            assert client_id is not None
            made = client.connection_providers.create(
                name, client_id=client_id, client_secret=secret, issuer=issuer,
                authorization_endpoint=authorization_endpoint, token_endpoint=token_endpoint,
                revocation_endpoint=revocation_endpoint, device_authorization_endpoint=device_endpoint,
                scopes=list(scopes))
            provider = made.id
        assert provider is not None
        info = client.connections.create(name, provider, scopes=list(scopes) if scopes and not new_provider
                                         else None)
    emit_made(info, as_json, info.id,
              f"connection {info.name!r} added; sign in with `capsa connections login {info.name}`")


@connections.command("login")
@click.argument("name")
@click.option("--device", is_flag=True, help="The device grant: print a code to enter elsewhere, then poll.")
@click.option("--no-browser", is_flag=True, help="Print the authorization URL only.")
@click.option("--no-wait", is_flag=True, help="Return once the sign-in is started.")
@click.option("--timeout", "wait", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the sign-in.")
@json_api_options
def login(name: str, device: bool, no_browser: bool, no_wait: bool, wait: float, as_json: bool,
          api: ApiOptions) -> None:
    """Sign in to connection NAME: open the authorization URL (the provider redirects back to capsa),
    or with --device show the user code and verification URI and poll until it is approved."""
    with reports_errors(), api.client() as client:
        before = client.connections.get(name).connected_at
        started = client.connections.login(name, device=device)
        if device:
            where = started.verification_uri_complete or started.verification_uri
            click.echo(f"open {where} and enter the code {started.user_code}", err=True)
            click.echo(started.user_code or "")
        else:
            assert started.authorization_url is not None
            click.echo(started.authorization_url)
            if not no_browser and sys.stdout.isatty():
                click.launch(started.authorization_url)
        if no_wait:
            if as_json:
                emit_json(started)
            return
        if device:
            info = client.connections.wait_for_device(name, started, deadline=wait)
        else:
            info = client.connections.wait_until_active(name, after=before, deadline=wait)
    if as_json:
        emit_json(info)
        return
    click.echo(f"signed in: connection {info.name!r} is {info.state}", err=True)


listing_command(connections, "List connections (never a token).", lambda client: client.connections.list(),
                ["ID", "NAME", "PROVIDER", "STATE", "TOKEN EXPIRES", "REFRESHES", "CONNECTED"],
                lambda c: [c.id, c.name, c.provider, c.state, human_time(c.access_expires_at),
                           str(c.refreshes), human_time(c.connected_at)])


@connections.command("revoke")
@click.argument("name")
@json_api_options
def revoke(name: str, as_json: bool, api: ApiOptions) -> None:
    """Revoke connection NAME: injection stops at once on every node, the provider revokes the tokens."""
    out = api.call(lambda client: client.connections.revoke(name))
    note = "" if out.provider_revoked else " (the provider did not confirm revoking its tokens)"
    if out.nodes_unreached:
        note += f"; nodes not reached: {', '.join(out.nodes_unreached)}"
    emit_made(out, as_json, out.connection.id, f"revoked connection {out.connection.name!r}{note}")


listing_command(connections, "List the registered OAuth providers (never a client secret).",
                lambda client: client.connection_providers.list(),
                ["ID", "NAME", "CLIENT ID", "TOKEN ENDPOINT", "SCOPES"],
                lambda p: [p.id, p.name, p.client_id, p.token_endpoint, " ".join(p.scopes) or "-"],
                name="providers")

"""``capsa keys``: create, list and revoke API keys (needs an admin key)."""

from __future__ import annotations

import click

from capsa.cli.output import ApiOptions, emit_made, emit_result, human_time, json_api_options, listing_command

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """Manage API keys (admin only)."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to.")
@click.option("--admin", is_flag=True, help="Allow the key to manage keys and nodes.")
@click.option("--name", default=None, help="A label to recognise the key by.")
@json_api_options
def create(tenant: str, admin: bool, name: str | None, as_json: bool, api: ApiOptions) -> None:
    """Create a key and print it. The secret is shown only this once."""
    key = api.call(lambda client: client.keys.create(tenant, admin=admin, name=name))
    # `KEY=$(capsa keys create --tenant t)` gets the key alone.
    role = "admin " if key.admin else ""
    emit_made(key, as_json, key.key,
              f"created {role}key {key.id} for tenant {key.tenant}; it cannot be shown again")


listing_command(keys, "List keys (never their secrets).", lambda client: client.keys.list(),
                ["ID", "TENANT", "ADMIN", "NAME", "CREATED", "REVOKED"],
                lambda k: [k.id, k.tenant, "yes" if k.admin else "no", k.name or "-",
                           human_time(k.created_at), human_time(k.revoked_at)])


@keys.command("revoke")
@json_api_options
@click.argument("key_id")
def revoke(as_json: bool, api: ApiOptions, key_id: str) -> None:
    """Revoke KEY_ID; requests with it fail from now on."""
    key = api.call(lambda client: client.keys.revoke(key_id))
    emit_result(key, as_json, f"revoked {key.id}")

"""Control plane settings, read from ``CAPSA_*`` environment variables or passed explicitly."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ControlSettings"]


class ControlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPSA_", extra="ignore")

    database_url: str = "sqlite+aiosqlite:////var/lib/capsa/capsa.db"
    bootstrap_key: str | None = None
    """An admin key (``csk_<id>_<secret>``) to install at startup; otherwise one is generated once."""
    bootstrap_tenant: str = "admin"

    session_create_limit: int = 60
    """Session creations allowed per API key per rate window."""
    command_limit: int = 600
    """Command executions allowed per API key per rate window."""
    rate_window_seconds: int = 60

    reaper_interval: float = 2.0
    """Seconds between reaper passes (expired sessions, silent nodes); 0 disables the reaper."""
    node_heartbeat_timeout: float = 30.0
    """A node that has not sent a heartbeat for this long is considered gone."""
    node_request_timeout: float = 120.0
    """Timeout for non-streaming calls to a node (sandbox creation under TCG can take a while)."""
    max_file_bytes: int = 1 << 30
    """Largest file upload accepted through the API."""
    default_command_timeout: float = 60.0

    secret_key: SecretStr | None = None
    """Base64 of 32 random bytes: the key secrets are encrypted with at rest (``CAPSA_SECRET_KEY``)."""
    secret_key_file: Path | None = None
    """A file holding that key (``capsa serve`` creates one, mode 0600, in its state directory)."""
    rolling_snapshot_interval: float = 2.0
    """Seconds between passes that take due rolling snapshots; 0 disables them in this replica."""

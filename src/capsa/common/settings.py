"""Settings shared by every capsa process, read from ``CAPSA_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "default_cache_dir", "default_state_dir"]


def default_state_dir() -> Path:
    return Path("/var/lib/capsa")


def default_cache_dir() -> Path:
    return Path("/var/cache/capsa")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPSA_", extra="ignore")

    state_dir: Path = default_state_dir()
    """Per-node mutable state: VM workdirs, database (embedded mode), keys."""
    cache_dir: Path = default_cache_dir()
    """Built guest images and downloaded packages, keyed by their inputs; safe to delete."""
    accel: str = "auto"
    """auto | kvm | tcg"""
    command_aslr: Literal["auto", "on", "off"] = "auto"
    """Whether commands in a sandbox get a randomized address-space layout (``CAPSA_COMMAND_ASLR``).
    ``auto``: on with KVM, off under TCG, where every randomized process start-up is translated again
    (twice the time of a short command; see capsa.guest.layout). Read when a VM starts or is restored."""
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"

"""Settings shared by every capsa process, read from ``CAPSA_*`` environment variables."""

from __future__ import annotations

from pathlib import Path

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
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"

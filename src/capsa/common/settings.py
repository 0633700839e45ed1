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
    sandbox_ram: Literal["private", "shared"] = "private"
    """How a sandbox restored from a template (warm pool or on demand) maps its RAM
    (``CAPSA_SANDBOX_RAM``). ``private``: its own reflink of the template's RAM file, mapped privately,
    so what the guest writes stays in the QEMU process (``RamMode.CLONE``); a pause or snapshot then
    writes the RAM in its stream. ``shared``: the reflink mapped shared (``RamMode.COPY``), so a pause is a
    reflink, but every page the guest writes goes through the storage pool's page cache and back to disk:
    measured here, a pooled sandbox's ``true`` cost 78-106 ms and 1,200-1,700 host page faults shared
    against 32-44 ms and 20-70 faults private. Templates whose spec says ``ram: private`` are always
    private."""
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"

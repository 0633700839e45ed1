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
    sandbox_ram: Literal["shared", "private"] = "shared"
    """How a sandbox restored from a template (warm pool or on demand) maps its RAM
    (``CAPSA_SANDBOX_RAM``). ``shared`` (the default): its own reflink of the template's RAM file mapped
    shared (``RamMode.COPY``), so a pause or snapshot is a reflink of that file. ``private``: the reflink
    mapped privately (``RamMode.CLONE``): what the guest writes stays in the QEMU process and never goes
    back to the storage pool, so first writes cost less (a pooled sandbox's first ``true`` is as fast as
    its tenth), but a pause or snapshot writes the whole RAM into its stream and a resume reads it back.
    Measured in one session on this 2-core TCG host (bench/fast_paths.py, p50, shared vs private): pool
    create + first ``true`` 78.5 vs 66.6 ms, first vs tenth ``true`` 43.0/34.7 vs 34.6/35.6 ms, restore
    on demand + first ``true`` 584 vs 538 ms, resume 296 vs 502 ms, branch into 4 646 vs 1357 ms.
    Templates whose spec says ``ram: private`` (browser, desktop) are always private."""
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"

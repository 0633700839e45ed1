"""Settings shared by every capsa process, read from ``CAPSA_*`` environment variables."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, SecretStr
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from capsa.common.egress_networks import parse_networks

__all__ = ["AllowNetworks", "Settings", "default_cache_dir", "default_state_dir"]


def _networks(value: object) -> object:
    return list(parse_networks(value)) if isinstance(value, str | list | tuple) else value


AllowNetworks = Annotated[list[ipaddress.IPv4Network | ipaddress.IPv6Network], NoDecode,
                          BeforeValidator(_networks)]
"""An operator's allow-list of networks (CIDRs) an outbound path may reach although they are not public
(private, loopback, link-local...): in the environment a comma- or space-separated list
(``10.20.0.0/16,fd00:1::/64``), empty by default. Host bits set (``10.0.0.1/8``) are refused."""


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
    image_bundle_dir: Path = Path("/usr/share/capsa/images")
    """Guest images shipped packed (``<config digest>.tar.zst``, capsa.images.bundle): a node that finds no
    image for its sources in ``cache_dir`` unpacks the matching bundle from here before it would build one
    (the container image carries one; ``CAPSA_IMAGE_BUNDLE_DIR``)."""
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
    template_sharing: Literal["off", "tenant", "all"] = "off"
    """Whether sandboxes restored from one template share its clean RAM pages (``CAPSA_TEMPLATE_SHARING``).
    ``tenant``: a sandbox restored on demand maps the template's RAM privately from a sealed copy that only
    the same tenant's sandboxes of that template share (one copy of its non-zero pages per tenant and
    template on the node; what a guest writes is its own); warm-pool sandboxes, restored before their
    tenant is known, keep their own RAM file. ``all``: pooled and on-demand sandboxes of every tenant share
    one copy per template: less memory, but tenants then share physical pages, which exposes them to
    flush+reload timing side channels between each other (docs/security.md). ``off`` (the default):
    ``sandbox_ram`` decides. Pauses and snapshots of a sharing sandbox record only the pages that differ
    from the template; a resume gets its own RAM again."""
    store_url: str | None = None
    """The fleet's shared snapshot and template store (``file:///path`` or ``s3://bucket/prefix``); none:
    snapshots and templates stay on the node that made them (capsa.store)."""
    store_s3_endpoint: str | None = None
    """The S3 endpoint for anything but AWS (MinIO, Ceph RGW, R2, Swift's s3api)."""
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"
    webhook_allow_networks: AllowNetworks = []
    """Networks the node's approval webhooks may reach although they are not public
    (``CAPSA_WEBHOOK_ALLOW_NETWORKS``, see :data:`AllowNetworks`): an approval service on the operator's
    own network. Every other webhook destination must resolve only to public addresses, which the node
    pins for the connection (policies naming another are refused with ``destination_refused``)."""
    approval_webhook_secret: SecretStr | None = None
    """The key the node signs approval webhook notifications with (``CAPSA_APPROVAL_WEBHOOK_SECRET``):
    HMAC-SHA256 over ``<timestamp>.<body>``, sent as ``X-Capsa-Signature: v1=<hex>`` beside
    ``X-Capsa-Timestamp`` (see docs/approvals.md). One key per deployment, shared by every receiver:
    give it only to receivers the operator trusts. Unset: notifications go out unsigned."""

"""An image's configuration, read from its OCI layout and checked.

``index.json`` names the manifest by its tag (the ``org.opencontainers.image.ref.name`` annotation); the
manifest names the config blob. Each blob is read from ``blobs/sha256/`` only after its descriptor's digest
and size are checked, and its bytes must hash to that digest. The result is an :class:`ImageConfig` with
what a template uses of the image: ``ENV``, ``WORKDIR``, ``USER``, ``ENTRYPOINT``, ``CMD``, its platform
(linux/amd64 only) and sizes. Failures are :class:`CapsaError` ``bad_image_config`` (400), or
``image_platform_unsupported`` (400) for another platform.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsa.common.errors import CapsaError

__all__ = ["ImageConfig", "read_image_config"]

MAX_JSON_BLOB = 4 << 20  # a manifest or a config larger than this is not an image we take
REF_NAME = "org.opencontainers.image.ref.name"
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",)
CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json",)
_DIGEST = re.compile(r"sha256:([a-f0-9]{64})")


def _bad(why: str) -> CapsaError:
    return CapsaError(f"invalid image: {why}", code="bad_image_config", status=400)


@dataclass(frozen=True)
class ImageConfig:
    """What a template takes from an image. ``entrypoint`` and ``cmd`` are argv lists (empty when unset);
    ``size`` is the compressed bytes of the config and layers; ``digest`` the config blob's digest,
    ``manifest_digest`` the layout's manifest's."""

    env: Mapping[str, str]
    working_dir: str | None
    user: str | None
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    os: str
    architecture: str
    digest: str
    manifest_digest: str
    size: int
    layers: int

    @property
    def platform(self) -> str:
        return f"{self.os}/{self.architecture}"


def _blob(layout: Path, descriptor: Any, what: str,
          media_types: tuple[str, ...]) -> tuple[dict[str, Any], str, int]:
    """The JSON object in the blob ``descriptor`` names, with the blob's digest and size."""
    if not isinstance(descriptor, dict):
        raise _bad(f"the {what} descriptor is not an object")
    digest, size, media = descriptor.get("digest"), descriptor.get("size"), descriptor.get("mediaType")
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise _bad(f"the {what} descriptor has no sha256 digest")
    if not isinstance(size, int) or not 0 <= size <= MAX_JSON_BLOB:
        raise _bad(f"the {what} descriptor's size is not between 0 and {MAX_JSON_BLOB}")
    if media not in media_types:
        raise _bad(f"the {what} is of type {media!r}, not {' or '.join(media_types)}")
    path = layout / "blobs" / "sha256" / match.group(1)
    try:
        with path.open("rb") as blob:
            data = blob.read(size + 1)
    except OSError as exc:
        raise _bad(f"cannot read the {what} blob {digest}: {exc.strerror}") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != match.group(1):
        raise _bad(f"the {what} blob does not match its descriptor's digest and size ({digest})")
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise _bad(f"the {what} blob is not a JSON object")
    return doc, match.group(0), size


def _index_entry(layout: Path, tag: str) -> dict[str, Any]:
    try:
        with (layout / "index.json").open("rb") as file:
            raw = file.read(MAX_JSON_BLOB + 1)
        index = json.loads(raw) if len(raw) <= MAX_JSON_BLOB else None
    except (OSError, ValueError):
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        raise _bad(f"{layout} has no readable index.json")
    found = [m for m in index["manifests"]
             if isinstance(m, dict) and isinstance(m.get("annotations"), dict)
             and m["annotations"].get(REF_NAME) == tag]
    if len(found) != 1:
        raise _bad(f"{layout} has {len(found)} manifests tagged {tag!r}, not one")
    entry: dict[str, Any] = found[0]
    return entry


def _strings(config: dict[str, Any], key: str) -> tuple[str, ...]:
    value = config.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(f"the config's {key} is not a list of strings")
    return tuple(value)


def _optional(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _bad(f"the config's {key} is not a string")
    return value


def _env(config: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in _strings(config, "Env"):
        name, eq, value = entry.partition("=")
        if not eq or not name:
            raise _bad(f"an Env entry is not NAME=VALUE: {entry[:80]!r}")
        env[name] = value
    return env


def read_image_config(layout: Path, tag: str) -> ImageConfig:
    """Read and check the config of ``layout:tag``: a single linux/amd64 OCI image."""
    entry = _index_entry(layout, tag)
    manifest, manifest_digest, _ = _blob(layout, entry, "manifest", MANIFEST_TYPES)
    image, config_digest, config_size = _blob(layout, manifest.get("config"), "config", CONFIG_TYPES)
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, dict) and isinstance(x.get("size"), int)
                                               and x["size"] >= 0 for x in layers):
        raise _bad("the manifest's layers are not a list of descriptors with sizes")
    os_name, arch = image.get("os"), image.get("architecture")
    if os_name != "linux" or arch != "amd64":
        raise CapsaError(f"the image is for {os_name}/{arch}; only linux/amd64 images are supported",
                         code="image_platform_unsupported", status=400)
    config = image.get("config") or {}
    if not isinstance(config, dict):
        raise _bad("the image's config is not an object")
    return ImageConfig(
        env=_env(config), working_dir=_optional(config, "WorkingDir"), user=_optional(config, "User"),
        entrypoint=_strings(config, "Entrypoint"), cmd=_strings(config, "Cmd"), os=os_name, architecture=arch,
        digest=config_digest, manifest_digest=manifest_digest,
        size=config_size + sum(x["size"] for x in layers), layers=len(layers))

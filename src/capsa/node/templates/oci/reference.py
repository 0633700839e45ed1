"""An OCI image reference, parsed and checked before any tool sees it.

The accepted form is ``[registry[:port]/]repository[:tag][@sha256:digest]``, read as Docker reads it: the
first path component names a registry when it holds a ``.`` or a ``:`` or is ``localhost``; otherwise the
registry is Docker Hub (``docker.io``), and a one-component repository there is under ``library/``. A
reference with neither tag nor digest means the tag ``latest``. Only ``sha256`` digests are accepted (the
digest the layout's blobs are checked with). Credentials in a reference (``user:password@host/...``) are not
part of the grammar and are refused like any other malformed reference, without echoing it. IPv6 registry
addresses (``[::1]:5000``) are not accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from capsa.common.errors import CapsaError

__all__ = ["DEFAULT_REGISTRY", "ImageReference", "parse_reference"]

DEFAULT_REGISTRY = "docker.io"
MAX_NAME = 255  # registry and repository together, as the distribution registry bounds them
MAX_REFERENCE = 1024

_HOST_PART = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_REGISTRY = re.compile(rf"{_HOST_PART}(?:\.{_HOST_PART})*(?::[0-9]{{1,5}})?")
_PATH_PART = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")


def _bad(why: str) -> CapsaError:
    return CapsaError(f"invalid image reference: {why}", code="bad_image_reference", status=400)


@dataclass(frozen=True)
class ImageReference:
    """A parsed reference: ``registry`` (host, with ``:port`` when given), ``repository`` (path components
    joined by ``/``), and a ``tag``, a ``digest`` or both (a digest, when given, is what is pulled)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """``registry/repository``, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    def pinned(self, digest: str) -> ImageReference:
        """The same image pinned to the manifest ``digest`` (the tag kept for display)."""
        if not _DIGEST.fullmatch(digest):
            raise _bad("a digest must be sha256: and 64 lowercase hex digits")
        return ImageReference(self.registry, self.repository, self.tag, digest)


def _split_registry(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if not _REGISTRY.fullmatch(first):
            raise _bad("the registry must be a host name or address with an optional :port")
        port = first.rpartition(":")[2] if ":" in first else None
        if port is not None and not 0 < int(port) < 65536:
            raise _bad("the registry's port must be between 1 and 65535")
        registry, repository = first, rest
    else:
        registry, repository = DEFAULT_REGISTRY, name
    if registry == DEFAULT_REGISTRY and "/" not in repository:
        repository = f"library/{repository}"
    return registry, repository


def parse_reference(text: str) -> ImageReference:
    """Parse ``text`` into an :class:`ImageReference`; a :class:`CapsaError` with the code
    ``bad_image_reference`` (400) says what is wrong with it otherwise."""
    if not text or len(text) > MAX_REFERENCE:
        raise _bad(f"give a reference of 1 to {MAX_REFERENCE} characters")
    if text != text.strip() or any(c.isspace() or not c.isprintable() for c in text):
        raise _bad("a reference has no spaces or control characters")
    if "://" in text:
        raise _bad("give the reference without a scheme (no docker:// or https://)")
    rest, at, digest = text.partition("@")
    if at and not _DIGEST.fullmatch(digest):
        raise _bad("a digest must be sha256: and 64 lowercase hex digits")
    # A tag is after the last ':' that follows the last '/' (a ':' before it is a registry's port).
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    tag: str | None = None
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise _bad("a tag is 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'")
    registry, repository = _split_registry(rest)
    parts = repository.split("/")
    if not all(_PATH_PART.fullmatch(p) for p in parts):
        raise _bad("a repository is '/'-separated lowercase components of letters, digits and separators "
                   "('.', '_', '__' or '-') between them")
    if len(registry) + 1 + len(repository) > MAX_NAME:
        raise _bad(f"the registry and repository are longer than {MAX_NAME} characters")
    if tag is None and not at:
        tag = "latest"
    return ImageReference(registry, repository, tag, digest if at else None)
